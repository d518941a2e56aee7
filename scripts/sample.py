"""Sample text from a trained data=text run: `python -m rnnlab.sample` (rnnlab/sample.py),
kept as a script so that existing commands still work."""

if __name__ == "__main__":
    from rnnlab.sample import main

    raise SystemExit(main())
