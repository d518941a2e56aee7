"""Summarise a sweep: a table row per job, and plots: `python -m rnnlab.summarize` (rnnlab/summarize.py),
kept as a script so that existing commands still work."""

if __name__ == "__main__":
    from rnnlab.summarize import main

    raise SystemExit(main())
