from rnnlab.zoo.cli import main

raise SystemExit(main())
