"""The daemons' settings as Markdown, generated from the models (``docs/configuration.md``).

Regenerate after changing a setting: ``python -m torshmon.settings_doc docs/configuration.md``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from torshmon.settings import (
    DURATION_HELP,
    SIZE_HELP,
    FieldSpec,
    Layers,
    constraint_text,
    field_specs,
    kind_text,
)

_INTRO = f"""\
# Configuration

This page is generated from the settings models (`torshmon/agent/settings.py`,
`torshmon/aggregator/settings.py` and the detectors' sections, `torshmon/probe/settings.py`);
do not edit it by hand (`python -m torshmon.settings_doc docs/configuration.md`). The
probe's settings, `torshmon.attach`'s keywords, are [at the end](#the-probe-torshmonattach).

`torshmon agent` and `torshmon aggregator` take each setting from the first of:

1. a command-line flag,
2. its environment variable,
3. the YAML file given with `--config FILE` (the setting's name as the key; a section
   such as `straggler` is a mapping),
4. its default.

Settings whose names end in `_s` are seconds and also take durations such as `500ms`,
`2m`, `1h` or `1h30m` ({DURATION_HELP}); those ending in `_bytes` take sizes such as
`64MiB` or `1GB` ({SIZE_HELP}). Booleans take `true`/`false`, `yes`/`no`, `on`/`off`,
`1`/`0`. A list from an environment variable is comma-separated, a mapping
`name=value` pairs, comma-separated (`fp16=0.1,int8=0.05`).

A bad value stops the daemon at start with one line naming the setting, where it came
from (`file:line`, the variable) and what is allowed. Secrets (tokens, database and
OTLP URLs, webhook URLs) are never shown in messages, logs or `repr`. A variable set to
nothing counts as unset, except `TORSHMON_TOKEN`, which is refused: a substitution that
failed would otherwise run without a token.

An aggregator config file:

```yaml
# /etc/torshmon/aggregator.yaml
host: 0.0.0.0
db_url: postgresql://torshmon:secret@db:5432/torshmon
raw_retention_s: 7d
straggler:
  min_slowdown: 0.2       # name ranks 20 % slower than their peers
  persistence: 6
hang:
  timeout_s: 30s
tuner:
  max_trials: 8
evidence:
  max_bytes: 10GiB
notify:
  slack:
    - url: https://hooks.slack.com/services/T000/B000/XXXX
  webhooks:
    - url: https://hooks.example.com/torshmon
      name: oncall
      bearer_token: s3cret
  alertmanagers:
    - base_url: http://alertmanager:9093
```

The token is best given with `--token-file FILE` or `TORSHMON_TOKEN`; a config file
that holds secrets must be readable by the daemon's user only. Settings of earlier
versions that moved into a section are refused with their new place named (in a file
or a variable): the aggregator's `hang_timeout_s` is `hang: {{timeout_s: ...}}`
now, and `evidence_dir`, `evidence_capture_max_bytes`, `evidence_max_bytes`,
`evidence_retention_s` and `evidence_min_interval_s` are `dir`, `capture_max_bytes`,
`max_bytes`, `retention_s` and `min_interval_s` of `evidence:`.
"""

_PROBE_INTRO = """\
## The probe (`torshmon.attach`)

The probe in each training process takes each setting from the first of:

1. `torshmon.attach`'s keyword of the same name (`attach(ddp, fast_lane=False)`; None
   counts as not given), or the integration's (`TorshmonCallback(fast_lane=False)`,
   checked when the callback is built),
2. its environment variable, so that an operator can set it for every rank under
   torchrun, the script unchanged,
3. its default.

There is no config file and there are no flags. A keyword is checked strictly: one the
probe has not, or of the wrong type (`fast_lane="off"`), is a TypeError; a variable is
read as the daemons read theirs. Any bad value stops `attach` with one line naming the
keyword or the variable, before the first step: a mistake in the settings fails fast at
start-up, never mid-run. Under `torshmon run` (the zero-code attach) the settings are read from the
variables once, as torch is imported; a bad one leaves the job training unwatched, with
one line on stderr. `TORSHMON_AUTO` switches the zero-code attach on (`torshmon run`
sets it); it is no setting of this table: the bootstrap that reads it runs before
torshmon may be imported, and imports it only when it says so. `agent_user` names the
agent's user where it is not the job's own ([security.md](security.md)); `run_id` names
the launch where torchrun does not ([report.md](report.md)): torchrun's
`$TORCHELASTIC_RUN_ID` comes before `TORSHMON_RUN_ID` where it names one (not `none`).
"""


def render() -> str:
    """The whole page."""
    from torshmon.agent.settings import ENV_PREFIX as AGENT_PREFIX
    from torshmon.agent.settings import AgentSettings
    from torshmon.aggregator.settings import ENV_PREFIX as AGGREGATOR_PREFIX
    from torshmon.aggregator.settings import AggregatorSettings
    from torshmon.probe.settings import ENV_PREFIX as PROBE_PREFIX
    from torshmon.probe.settings import ProbeSettings

    parts = [_INTRO]
    parts += _model("torshmon agent", AgentSettings, AGENT_PREFIX)
    parts += _model("torshmon aggregator", AggregatorSettings, AGGREGATOR_PREFIX)
    parts += [_PROBE_INTRO]
    parts += _table(ProbeSettings, (), Layers(ProbeSettings, env_prefix=PROBE_PREFIX), flags=False)
    return "\n".join(parts)


def _model(title: str, model: type, env_prefix: str) -> Iterator[str]:
    layers: Layers[Any] = Layers(model, env_prefix=env_prefix)
    yield f"## `{title}`\n"
    yield from _table(model, (), layers)
    yield from _sections(model, (), layers)


def _sections(model: type, prefix: tuple[str, ...], layers: Layers[Any]) -> Iterator[str]:
    """A heading and a table per nested section (``tuner.retune:`` one level deeper)."""
    for spec in field_specs(model):
        if spec.section is not None:
            path = (*prefix, spec.name)
            doc = (spec.section.__doc__ or "").strip().splitlines()[0]
            yield f"{'#' * (2 + len(path))} `{'.'.join(path)}:`\n\n{doc}\n"
            yield from _table(spec.section, path, layers)
            yield from _sections(spec.section, path, layers)


def _table(
    model: type, prefix: tuple[str, ...], layers: Layers[Any], *, flags: bool = True
) -> Iterator[str]:
    """The settings of one section; without ``flags``, no flag column (the probe's)."""
    header = ["setting", "default", "allowed", "variable", "flag", "what"]
    if not flags:
        header.remove("flag")
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for spec in field_specs(model):
        if spec.section is not None:
            continue
        path = (*prefix, spec.name)
        cells = [
            f"`{spec.name}`",
            _default(spec),
            _allowed(spec),
            f"`{layers.env_name(path, spec)}`",
            f"`{spec.flag}`" if spec.flag else "",
            _cell(spec.description or "") + (" (secret)" if spec.secret else ""),
        ]
        if not flags:
            del cells[4]
        rows.append("| " + " | ".join(cells) + " |")
    yield "\n".join(rows) + "\n"


def _default(spec: FieldSpec) -> str:
    if spec.default_text is not None:
        return _cell(spec.default_text)
    if spec.factory is not None or spec.default is msgspec.NODEFAULT:
        return ""
    if spec.default is None or spec.default == ():
        return "none"
    if isinstance(spec.default, bool):
        return str(spec.default).lower()
    return f"`{spec.default}`"


def _allowed(spec: FieldSpec) -> str:
    kind = kind_text(spec) or "a list of targets"
    kind = kind.split(" (")[0]  # the units are said once, above
    constraint = constraint_text(spec)
    return _cell(f"{kind} {constraint}" if constraint else kind)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def main(argv: list[str]) -> int:
    """Write the page to the file named in ``argv`` (stdout without one)."""
    text = render()
    if argv:
        Path(argv[0]).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
