"""The zoo: every cell under one protocol on a set of tasks, run resumably at one commit, recorded job by job under
docs/zoo/ and published as docs/results.md. `python -m rnnlab.zoo --help`; the protocol is `rnnlab.zoo.protocol`."""
