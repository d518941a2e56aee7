#!/usr/bin/env bash
# The quick benchmark set (scripts/asv/benchmarks/, about 3 minutes on 2 cores) through airspeed velocity:
# records HEAD's timings for this machine in scripts/asv/results/ and, given an earlier commit recorded on
# the same machine, flags the rows that got slower beyond the two records' run-to-run noise.
#   bash scripts/asv/quick.sh          # record HEAD (commit first: asv times the working tree, as installed)
#   bash scripts/asv/quick.sh main     # ... then compare with main's record (record main first, on this machine)
# A machine is its CPU model, core count and jax version, so a record is compared only with its own kind.
set -euo pipefail
cd "$(dirname "$0")"
machine=$(python - <<'PY'
# This machine's entry in ~/.asv-machine.json (written here: asv 0.6's `asv machine --yes --machine NAME`
# keeps only the name and the os of the other options).
import json, os, platform, re
from pathlib import Path
import jax
model = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")),
             platform.processor() or platform.machine())
slug = re.sub(r"[^a-z0-9]+", "-", re.sub(r"\((r|tm)\)|processor|cpu|@.*", "", model.lower())).strip("-")
cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
name = f"{slug}-{cores}c-jax{jax.__version__}"
ram = next((int(l.split()[1]) * 1024 for l in open("/proc/meminfo") if l.startswith("MemTotal")), 0)
path = Path.home() / ".asv-machine.json"
machines = json.loads(path.read_text()) if path.exists() else {"version": 1}
machines[name] = {"machine": name, "cpu": f"{model} ({cores} cores)", "num_cpu": str(cores), "arch": platform.machine(),
                  "os": f"{platform.system()} {platform.release()}", "ram": str(ram)}
path.write_text(json.dumps(machines, indent=4))
print(name)
PY
)
asv run -E existing --machine "$machine" --set-commit-hash "$(git rev-parse HEAD)" --show-stderr
if [ $# -gt 0 ]; then
    asv compare --machine "$machine" --factor 1.05 "$(git rev-parse "$1")" "$(git rev-parse HEAD)"
fi
