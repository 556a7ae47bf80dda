"""What each install and image of torshmon holds: torch only where training runs.

The package's metadata keeps torch in the ``torch`` extra, and the container image that
runs the agent and the aggregator installs the wheel without it (read from the
Dockerfile: there is no Docker engine here); the training image is a stage of its own.
The installs themselves run in tests/integration/test_install_*.py.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "agent" / "Dockerfile"
TORCH = re.compile(r"\btorch\b")


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[str] = field(default_factory=list)

    def lines(self, keyword: str) -> list[str]:
        return [i for i in self.instructions if i.split(maxsplit=1)[0] == keyword]


def dockerfile_stages() -> list[Stage]:
    """The build stages in order, each with its instructions (continuations joined)."""
    text = DOCKERFILE.read_text()
    logical = re.sub(r"\\\n\s*", " ", "\n".join(
        line for line in text.splitlines() if not line.lstrip().startswith("#")))  # fmt: skip
    stages: list[Stage] = []
    for line in logical.splitlines():
        words = line.split()
        if not words:
            continue
        if words[0] == "FROM":
            assert len(words) == 4 and words[2] == "AS", f"name every stage: {line}"
            stages.append(Stage(name=words[3], base=words[1]))
        else:
            stages[-1].instructions.append(line)
    return stages


def image(target: str | None) -> list[Stage]:
    """The stages whose files end up in the image of ``target`` (the last stage if None)."""
    stages = {s.name: s for s in dockerfile_stages()}
    stage = dockerfile_stages()[-1] if target is None else stages[target]
    chain = [stage]
    while chain[-1].base in stages:
        chain.append(stages[chain[-1].base])
    return chain


def wheel_installs(stage: Stage) -> list[tuple[set[str], list[str]]]:
    """(extras, pip options) of each ``pip install`` of the wheel, which must be mounted
    from the stage that built it."""
    installs = []
    for run in stage.lines("RUN"):
        match = re.search(r'"\$\(echo /dist/torshmon-\*\.whl\)\[([\w,]+)\]"', run)
        if match is None:
            continue
        assert "--mount=type=bind,from=wheel,source=/dist,target=/dist" in run
        options = shlex.split(run[run.index("pip install") : match.start()])[2:]
        installs.append((set(match[1].split(",")), options))
    return installs


def test_torch_is_an_extra_not_a_dependency() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if TORCH.match(d)]
    assert project["optional-dependencies"]["torch"] == ["torch>=2.4"]
    setup = (ROOT / "scripts" / "setup").read_text()
    # The README's commands need torch and the aggregator; the integrations' tests their
    # trainers.
    assert '-e ".[dev,torch,aggregator,integrations-test]"' in setup


def test_the_aggregator_extra_is_what_the_cli_names_when_one_is_missing() -> None:
    """A command run where the aggregator's packages are not installed says in one line
    to install the extra: the CLI's list of them is the extra's."""
    from torshmon.cli import AGGREGATOR_PACKAGES

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    names = {re.split(r"[\[<>=]", r)[0].split("-")[0] for r in extras["aggregator"]}
    assert names == AGGREGATOR_PACKAGES
    base = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not {re.split(r"[\[<>=]", r)[0] for r in base} & AGGREGATOR_PACKAGES


def test_the_wheel_is_built_once_from_the_package() -> None:
    wheel = next(s for s in dockerfile_stages() if s.name == "wheel")
    (build,) = wheel.lines("RUN")
    assert "pip wheel" in build and "--no-deps -w /dist ." in build
    assert "-e" not in shlex.split(build)


def test_the_daemons_image_is_the_default_and_holds_no_torch() -> None:
    chain = image(None)
    assert chain[0].name == "daemons"
    for stage in chain:
        assert stage.base == "python:3.11-slim" or stage.base in {s.name for s in chain}
        for instruction in stage.instructions:
            assert not TORCH.search(instruction), f"{stage.name}: {instruction}"
    (install,) = wheel_installs(chain[0])
    assert install == ({"aggregator", "gpu"}, [])
    assert chain[0].lines("ENTRYPOINT") == ['ENTRYPOINT ["torshmon"]']


def test_the_trainer_image_pins_torch_before_the_wheel() -> None:
    (trainer, runtime) = image("trainer")
    assert runtime.name == "runtime"
    pin = re.search(r"TORSHMON_TORCH:-torch==([\d.]+)", (ROOT / "scripts" / "setup").read_text())
    assert pin is not None
    args = dict(line.split(maxsplit=1)[1].split("=", 1) for line in trainer.lines("ARG"))
    assert args["TORCH_VERSION"] == pin[1] == "2.13.0"
    runs = trainer.lines("RUN")
    assert 'pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"' in runs[0]
    assert 'echo "torch==${TORCH_VERSION}" > /tmp/constraints.txt' in runs[1]
    (install,) = wheel_installs(trainer)
    assert install == ({"torch", "gpu"}, ["-c", "/tmp/constraints.txt"])
    assert trainer.lines("ENTRYPOINT") == ['ENTRYPOINT ["torchrun"]']


def test_compose_and_kubernetes_run_the_daemons_from_the_torch_free_image() -> None:
    compose: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    daemons = services["agent"]["image"]
    assert services["aggregator"]["image"] == daemons
    for name in ("agent", "aggregator"):
        assert "target" not in services[name]["build"], name  # the last stage: daemons
    trainer = services["trainer"]
    assert trainer["build"]["target"] == "trainer" and trainer["image"] != daemons
    pod = yaml.safe_load((ROOT / "agent" / "k8s" / "torchrun-with-agent.yaml").read_text())
    spec = pod["spec"]["template"]["spec"]
    images = {c["name"]: c["image"] for c in spec["initContainers"] + spec["containers"]}
    assert images == {"torshmon-agent": daemons, "trainer": trainer["image"]}
