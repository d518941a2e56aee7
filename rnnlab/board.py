"""What TensorBoard shows of a run beyond its scalars: the HParams entry (the keys that tell the runs of
a sweep apart, the metrics to compare them by, the run's status), a custom-scalars layout that puts
train and eval curves on one chart, and the config and command-line overrides as text.
Histograms and per-layer gradient norms come from `rnnlab.param_stats`.

Scalars themselves are `rnnlab.metrics.MetricWriter`'s; this module decides what to register.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import yaml
import rnnlab.tbx  # noqa: F401  (first: tensorboardX without torch and boto3)
from tensorboardX.proto.api_pb2 import Status
from tensorboardX.proto.plugin_hparams_pb2 import HParamsPluginData, SessionEndInfo
from tensorboardX.proto.summary_pb2 import Summary, SummaryMetadata

# Shown for every run, whatever the sweep: what a reader of a results table asks first.
# The fixed HParams; state_floats is the cell's recurrent state per layer (`Cell.state_floats`), not a config key.
HPARAM_KEYS = ("model.cell", "hidden_dim", "num_layers", "optimizer.lr", "batch_size", "data.task", "data.seq_len",
               "state_floats")
# A config-group override (`model=lstm`) names the group; the flat key that holds its choice:
GROUP_KEYS = {"model": "model.cell", "data": "data.task", "optimizer": "optimizer.name", "device": "device.platform"}
DIFFERS_TRUE = bytes([7 << 3 | 0, 1])  # HParamInfo.differs = true: field 7, varint, value 1
# results.json's status -> the HParams plugin's session status (its Status filter): a preempted run will go on.
SESSION_STATUS = {"completed": "STATUS_SUCCESS", "preempted": "STATUS_RUNNING", "diverged": "STATUS_FAILURE",
                  "failed": "STATUS_FAILURE", "aborted": "STATUS_FAILURE"}


def override_key(override: str) -> str:
    """The key an override sets: `+model.r_min=0.5` -> model.r_min, `~x` -> x, `model=lstm` -> model."""
    return override.split("=", 1)[0].lstrip("+~")


def overridden_keys(overrides: Sequence[str], flat: Mapping[str, Any]) -> list[str]:
    """The flat config keys a run's command-line overrides set (`hidden_dim=32`, `+model.r_min=0.5`,
    `model=lstm` -> model.cell); Hydra's own keys and presets that are not config keys are left out."""
    keys = []
    for override in overrides:
        key = GROUP_KEYS.get(override_key(override), override_key(override))
        if key in flat and key not in keys:
            keys.append(key)
    return keys


def run_hparams(flat: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """The HParams of a run: the keys its overrides set, then `HPARAM_KEYS` (a dict, in that order)."""
    keys = dict.fromkeys([*overridden_keys(overrides, flat), *HPARAM_KEYS])
    return {k: flat[k] for k in keys if k in flat}


def scalars_layout(metric_names: Sequence[str], eval_seq_lens: Sequence[int], layer_norms: bool = False) -> dict:
    """The custom-scalars layout: loss (train, eval and the task's baseline) on one chart, each task
    metric train against eval, each at every further eval length, and with `layer_norms` (histograms
    on) every layer's gradient norm on one chart. Tags are anchored regexes."""
    def tags(*names: str) -> list[str]:
        return [f"^{name}$" for name in names]

    charts = {"loss: train, eval, baseline": ["Multiline", tags("train/loss", "eval/loss", "eval/baseline_loss")]}
    for name in metric_names:
        charts[f"{name}: train, eval"] = ["Multiline", tags(f"train/{name}", f"eval/{name}")]
    for name in ("loss", *metric_names) if eval_seq_lens else ():
        charts[f"{name} by eval length"] = ["Multiline", tags(*(f"eval/{name}@{n}" for n in eval_seq_lens))]
    if layer_norms:
        charts["gradient norm by layer"] = ["Multiline", ["^grad_norm/"]]
    return {"rnnlab": charts}


def config_text(config: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, str]:
    """Text summaries (Markdown): the composed config as YAML, and the command line's overrides."""
    indented = lambda text: "\n".join("    " + line for line in text.splitlines())  # noqa: E731 (a code block)
    return {
        "config": indented(yaml.safe_dump(dict(config), sort_keys=False, default_flow_style=None)),
        "overrides": indented(" ".join(overrides)) if overrides else "(none: the defaults of conf/)",
    }


def mark_differing(experiment: Summary, keys: Sequence[str]) -> Summary:
    """Set `differs` on the HParamInfo of each of `keys` in tensorboardX's experiment summary. TensorBoard
    lists hparams that differ first and shows the first few (else alphabetically: `batch_size` before the
    swept `model.cell`). tensorboardX's copy of the proto lacks the field (7 in TensorBoard's api.proto),
    so it is added as its wire bytes, which protobuf keeps as an unknown field."""
    value = experiment.value[0]
    data = HParamsPluginData.FromString(value.metadata.plugin_data.content)
    for info in data.experiment.hparam_infos:
        if info.name in keys:
            info.MergeFromString(DIFFERS_TRUE)
    value.metadata.plugin_data.content = data.SerializeToString()
    return experiment


def session_end(status: str) -> Summary:
    """The HParams plugin's session-end summary with the run's status (`SESSION_STATUS`)."""
    info = SessionEndInfo(status=Status.Value(SESSION_STATUS.get(status, "STATUS_UNKNOWN")))
    content = HParamsPluginData(session_end_info=info, version=0).SerializeToString()
    metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="hparams", content=content))
    return Summary(value=[Summary.Value(tag="_hparams_/session_end_info", metadata=metadata)])


def describe_run(writer: Any, config: Mapping[str, Any], flat: Mapping[str, Any], overrides: Sequence[str],
                 varied: Sequence[str], metric_tags: Sequence[str], metric_names: Sequence[str], eval_seq_lens: Sequence[int],
                 layer_norms: bool = False) -> None:
    """Register a run with TensorBoard (`writer`: a `rnnlab.metrics.MetricWriter`): HParams (the keys
    `varied` sets, marked as differing between runs, then `HPARAM_KEYS`), layout, text (all `overrides`)."""
    writer.write_hparams(run_hparams(flat, varied), tuple(metric_tags), differs=overridden_keys(varied, flat))
    writer.write_layout(scalars_layout(metric_names, eval_seq_lens, layer_norms))
    writer.write_text(config_text(config, overrides))
