"""Evaluate trained runs at long lengths: `python -m rnnlab.eval_long` (rnnlab/eval_long.py),
kept as a script so that existing commands still work."""

if __name__ == "__main__":
    from rnnlab.eval_long import main

    raise SystemExit(main())
