"""The integrations in the real frameworks (Hugging Face Trainer, Lightning, Accelerate):
2 CPU gloo ranks, a real agent and aggregator on loopback, the history they write.

Each rank trains twice with the same seed, without torshmon and then with its one line,
so the test sees the losses and the weights the integration must leave unchanged.
Rank 1 is slowed inside its training forward passes (a straggler): the steps table shows
its compute time against rank 0's, and in the Accelerate test (long enough for the
straggler detector) the detector names it. The models are tiny and built from a config; nothing
is downloaded.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.integration.loopback import aggregator_and_agent
from torshmon.history.query import run_query
from torshmon.launch import run_ranks

pytestmark = pytest.mark.integration

TIMEOUT_S = 240
#: rank 1's extra time in each training forward pass (a slow rank)
STRAGGLER_S = 0.03
#: rank 1's compute time over rank 0's, at least: the sleep against a few-ms step
SLOW_RATIO = 2.0
#: each evaluation forward pass's extra time (on every rank), so evaluation is long
#: beside the loader's time
EVAL_PASS_S = 0.05
ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


async def _run_with_stack(
    tmp_path: Path, target: Callable[..., Any], *args: Any
) -> tuple[list[Any], str]:
    """Aggregator + agent on loopback, ``target`` on 2 gloo ranks; the history's URL once
    the agent has flushed and the aggregator written everything."""
    async with aggregator_and_agent(tmp_path, "integ") as (_, agent_settings):
        results = await asyncio.to_thread(
            run_ranks,
            target,
            2,
            agent_settings.socket_path,
            str(tmp_path),
            *args,
            timeout_s=TIMEOUT_S,
            env=ENV,
        )
    return results, f"sqlite:///{tmp_path / 'history.db'}"


def _rows(db_url: str, sql: str) -> list[tuple[Any, ...]]:
    return [tuple(row) for row in run_query(db_url, sql).rows]


def _check_steps(db_url: str, job: str, steps: int, samples: int) -> dict[int, list[Any]]:
    """One row per optimizer step per rank, with the batch size the framework knows;
    returns each rank's rows (step, compute_s, input_wait_s, loss) in step order."""
    rows = _rows(
        db_url,
        "SELECT rank, step, batch_size, compute_s, input_wait_s, loss FROM steps "
        f"WHERE job = '{job}' ORDER BY rank, step",
    )
    by_rank: dict[int, list[Any]] = {0: [], 1: []}
    for rank, step, batch_size, compute_s, input_wait_s, loss in rows:
        assert batch_size == samples, (rank, step, batch_size)
        by_rank[rank].append((step, compute_s, input_wait_s, loss))
    for rank in (0, 1):
        assert [r[0] for r in by_rank[rank]] == list(range(1, steps + 1)), rank
    return by_rank


def _check_straggler(by_rank: dict[int, list[Any]]) -> None:
    """Rank 1, slowed in its forward passes, computes longer than rank 0 (whose own
    extra time is waiting for rank 1 in DDP's all-reduce: communication, not compute)."""
    slow = statistics.median(r[1] for r in by_rank[1][1:])
    fast = statistics.median(r[1] for r in by_rank[0][1:])
    assert slow >= STRAGGLER_S and slow > SLOW_RATIO * fast, (slow, fast)


def _slow_forward(module: Any, rank: int) -> None:
    """Rank 1's training forward passes take STRAGGLER_S longer (a slow rank), and
    every evaluation pass EVAL_PASS_S."""
    import torch

    def hook(mod: Any, _args: Any) -> None:
        if not (mod.training and torch.is_grad_enabled()):
            time.sleep(EVAL_PASS_S)
        elif rank == 1:
            time.sleep(STRAGGLER_S)

    module.register_forward_pre_hook(hook)


def _same_weights(a: Any, b: Any) -> bool:
    import torch

    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# -- Hugging Face Trainer -------------------------------------------------------------

HF_STEPS = 4
HF_BATCH = 4
HF_ACCUMULATION = 2


def _hf_train(rank: int, out: str, callbacks: list[Any]) -> tuple[Any, list[float], list[float]]:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=32, n_positions=16, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    _slow_forward(model.transformer, rank)  # inside the model's forward pass
    generator = torch.Generator().manual_seed(1 + rank)
    tokens = torch.randint(0, 32, (64, 8), generator=generator)
    data = [{"input_ids": t, "labels": t} for t in tokens]
    args = TrainingArguments(
        output_dir=out,
        use_cpu=True,
        per_device_train_batch_size=HF_BATCH,
        gradient_accumulation_steps=HF_ACCUMULATION,
        max_steps=HF_STEPS,
        logging_steps=1,  # the Trainer's per-step all_gathers for its logs
        eval_strategy="steps",
        eval_steps=2,  # evaluation of the unwrapped model after step 2
        per_device_eval_batch_size=16,
        report_to="none",
        save_strategy="no",
        run_name="hf-run",
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=data, eval_dataset=data, callbacks=callbacks
    )
    trainer.train()
    logs = trainer.state.log_history
    losses = [h["loss"] for h in logs if "loss" in h]
    evals = [h["eval_runtime"] for h in logs if "eval_runtime" in h]
    return model, losses, evals


def _hf_rank(rank: int, world: int, sock: str, tmp: str) -> dict[str, Any]:
    from torshmon.integrations.huggingface import TorshmonCallback

    bare, bare_losses, _ = _hf_train(rank, f"{tmp}/bare{rank}", [])
    callback = TorshmonCallback(agent_socket=sock, flush_interval_s=0.05)
    watched, losses, evals = _hf_train(rank, f"{tmp}/watched{rank}", [callback])
    return {
        "identical": _same_weights(bare, watched) and bare_losses == losses,
        "losses": losses,
        "evals": evals,
    }


async def test_hugging_face_trainer_callback(tmp_path: Path) -> None:
    results, db_url = await _run_with_stack(tmp_path, _hf_rank)
    for rank, result in enumerate(results):
        assert result["identical"], rank
    by_rank = _check_steps(db_url, "hf-run", HF_STEPS, HF_BATCH * HF_ACCUMULATION)
    # Each rank's loss; the Trainer logs their mean.
    mean = [(a[3] + b[3]) / 2 for a, b in zip(by_rank[0], by_rank[1], strict=True)]
    assert mean == pytest.approx(results[0]["losses"], rel=1e-5)
    for rank in (0, 1):
        # The evaluation after step 2 (64 samples, 16 a pass on each of 2 ranks: 2 passes)
        # is not input wait before step 3.
        evaluation = results[rank]["evals"][0]
        assert evaluation >= 2 * EVAL_PASS_S
        after_eval = by_rank[rank][2][2]
        assert after_eval is not None and after_eval < evaluation / 4, (after_eval, evaluation)
    _check_straggler(by_rank)
    # What came between the steps, stored: the evaluation before step 3, the Trainer's
    # logging gathers (blocking collectives) before steps 2-4.
    split = _rows(
        db_url,
        "SELECT rank, step, eval_s, between_steps_comm_s FROM steps "
        "WHERE job = 'hf-run' AND step > 1 ORDER BY rank, step",
    )
    for rank, step, eval_s, comm_s in split:
        assert (eval_s >= 2 * EVAL_PASS_S) == (step == 3), (rank, step, eval_s)
        assert comm_s > 0, (rank, step)
    # The Trainer's logging gathers after each step, seen by the probe on both ranks and
    # filed with the step after them (split out of its input wait).
    gathers = _rows(
        db_url,
        "SELECT rank, step FROM collectives WHERE job = 'hf-run' AND op = 'all_gather' "
        "GROUP BY rank, step ORDER BY rank, step",
    )
    for rank in (0, 1):
        assert {2, 3, 4} <= {step for r, step in gathers if r == rank}, gathers


def test_the_integrations_package_imports_no_framework() -> None:
    """Each framework is an optional extra: only its own module imports it."""
    code = (
        "import sys, torshmon.integrations, torshmon.integrations._common; "
        "print(sorted(m for m in ('transformers', 'lightning', 'accelerate') "
        "if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]"


# -- Lightning --------------------------------------------------------------------------

PL_STEPS = 4
PL_BATCH = 4
PL_ACCUMULATION = 2


def _pl_train(
    rank: int, out: str, callbacks: list[Any], fsdp: bool = False
) -> tuple[Any, list[float]]:
    """Lightning's DDP strategy, or with ``fsdp`` its FSDP2 one (``ModelParallelStrategy``:
    the module shards its layers itself in ``configure_model``)."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    class Regression(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
            )
            self.losses: list[float] = []

        def configure_model(self) -> None:
            if fsdp:
                mesh = self.device_mesh["data_parallel"]
                for layer in (self.net[0], self.net[2]):
                    fully_shard(layer, mesh=mesh)
                fully_shard(self.net, mesh=mesh)

        def forward(self, x: Any) -> Any:
            return self.net(x)

        def training_step(self, batch: Any, _idx: int) -> Any:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self(x), y)
            self.losses.append(float(loss.detach()))
            return loss

        def validation_step(self, batch: Any, _idx: int) -> None:
            x, y = batch
            self.log("val_loss", torch.nn.functional.mse_loss(self(x), y), sync_dist=True)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    pl.seed_everything(0, verbose=False)
    module = Regression()
    _slow_forward(module.net, rank)
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 8, generator=generator), torch.randn(64, 1, generator=generator)
    data = torch.utils.data.TensorDataset(x, y)
    loader = torch.utils.data.DataLoader(data, batch_size=PL_BATCH)
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy if fsdp else "ddp",
        max_steps=PL_STEPS,
        accumulate_grad_batches=PL_ACCUMULATION,
        val_check_interval=2 * PL_ACCUMULATION,  # validation after optimizer step 2
        limit_val_batches=2,
        num_sanity_val_steps=0,
        logger=CSVLogger(out, name="pl-fsdp" if fsdp else "pl-run"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(module, loader, loader)
    return module, module.losses


def _pl_rank(rank: int, world: int, sock: str, tmp: str) -> dict[str, Any]:
    from torshmon.integrations.lightning import TorshmonCallback

    bare, bare_losses = _pl_train(rank, f"{tmp}/bare", [])
    callback = TorshmonCallback(agent_socket=sock, flush_interval_s=0.05)
    watched, losses = _pl_train(rank, f"{tmp}/watched", [callback])
    return {"identical": _same_weights(bare, watched) and bare_losses == losses, "losses": losses}


async def test_lightning_callback(tmp_path: Path) -> None:
    results, db_url = await _run_with_stack(tmp_path, _pl_rank)
    for rank, result in enumerate(results):
        assert result["identical"], rank
    by_rank = _check_steps(db_url, "pl-run", PL_STEPS, PL_BATCH * PL_ACCUMULATION)
    for rank in (0, 1):
        # The step's loss: its micro-batches' mean, as Lightning scales them.
        micro = results[rank]["losses"]
        expected = [statistics.mean(micro[i : i + 2]) for i in range(0, len(micro), 2)]
        assert [r[3] for r in by_rank[rank]] == pytest.approx(expected, rel=1e-5)
        # The validation after step 2 (2 passes) is not input wait before step 3.
        after_eval = by_rank[rank][2][2]
        assert after_eval is not None and after_eval < EVAL_PASS_S, after_eval
    _check_straggler(by_rank)
    # The validation's sync_dist all-reduces, recorded with the step after them (and
    # Lightning's own at fit start and end, with the first step and the closing record).
    reduces = _rows(
        db_url,
        "SELECT DISTINCT rank, step FROM collectives WHERE job = 'pl-run' "
        "AND op = 'all_reduce' ORDER BY rank, step",
    )
    assert {(0, 3), (1, 3)} <= set(reduces), reduces
    assert not {step for _, step in reduces} & {2, 4}, reduces  # no validation before them


def _pl_fsdp_rank(rank: int, world: int, sock: str, tmp: str) -> dict[str, Any]:
    import logging

    from torshmon.integrations.lightning import TorshmonCallback

    said: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("torshmon.integrations").addHandler(handler)
    logging.getLogger("torshmon.integrations").setLevel(logging.INFO)
    bare, bare_losses = _pl_train(rank, f"{tmp}/bare", [], fsdp=True)
    callback = TorshmonCallback(agent_socket=sock, flush_interval_s=0.05)
    watched, losses = _pl_train(rank, f"{tmp}/watched", [callback], fsdp=True)
    return {
        "identical": _same_weights(bare, watched) and bare_losses == losses,
        "losses": losses,
        "sharded": type(watched.net).__name__,
        "said": said,
    }


async def test_lightning_callback_under_fsdp2(tmp_path: Path) -> None:
    """Lightning's FSDP2 strategy (``ModelParallelStrategy``) on 2 CPU gloo ranks: the
    callback finds the sharded module, records each optimizer step with its all-gathers
    and reduce-scatters, and the losses and weights are those of a run without it."""
    async with aggregator_and_agent(tmp_path, "integ") as (aggregator, agent_settings):
        results = await asyncio.to_thread(
            run_ranks,
            _pl_fsdp_rank,
            2,
            agent_settings.socket_path,
            str(tmp_path),
            timeout_s=TIMEOUT_S,
            env=ENV,
        )
        kind = aggregator.live.job_kind("pl-fsdp")
        for _ in range(100):
            if kind is not None:
                break
            await asyncio.sleep(0.2)
            kind = aggregator.live.job_kind("pl-fsdp")
    db_url = f"sqlite:///{tmp_path / 'history.db'}"
    for rank, result in enumerate(results):
        assert result["identical"], rank
        assert result["sharded"].startswith("FSDP"), result["sharded"]  # fully_shard ran
        # The callback found the FSDP2 module inside the LightningModule and said so.
        said = "torshmon: FSDP2 in Regression: collectives and steps only"
        assert said in result["said"], result
    by_rank = _check_steps(db_url, "pl-fsdp", PL_STEPS, PL_BATCH * PL_ACCUMULATION)
    for rank in (0, 1):
        micro = results[rank]["losses"]
        expected = [statistics.mean(micro[i : i + 2]) for i in range(0, len(micro), 2)]
        assert [r[3] for r in by_rank[rank]] == pytest.approx(expected, rel=1e-5)
        # The validation after step 2 (2 passes) is not input wait before step 3.
        after_eval = by_rank[rank][2][2]
        assert after_eval is not None and after_eval < EVAL_PASS_S, after_eval
    # Every step all-gathers the sharded layers' parameters and reduce-scatters their
    # gradients, on both ranks.
    ops = _rows(
        db_url,
        "SELECT rank, step, "
        "sum(CASE WHEN op LIKE 'all_gather%' THEN count ELSE 0 END), "
        "sum(CASE WHEN op LIKE 'reduce_scatter%' THEN count ELSE 0 END) "
        "FROM collectives WHERE job = 'pl-fsdp' GROUP BY rank, step ORDER BY rank, step",
    )
    for rank in (0, 1):
        for step in range(1, PL_STEPS + 1):
            [(gathers, scatters)] = [(g, s) for r, st, g, s in ops if (r, st) == (rank, step)]
            assert gathers >= 2 and scatters >= 2, (rank, step, ops)
    # ... and the aggregator reads the job as FSDP2.
    assert kind == "fsdp2"


# -- Accelerate -------------------------------------------------------------------------

#: enough for the straggler detector (10 warm-up steps, 16 to sample the noise, 5 of 8)
ACC_STEPS = 60
ACC_BATCH = 4
ACC_ACCUMULATION = 2


def _acc_train(rank: int, sock: str | None) -> tuple[Any, list[float], float]:
    import torch
    from accelerate import Accelerator

    from torshmon.integrations.accelerate import watch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    _slow_forward(model[0], rank)  # inside the model's forward pass
    generator = torch.Generator().manual_seed(1 + rank)
    x, y = torch.randn(1024, 8, generator=generator), torch.randn(1024, 1, generator=generator)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=ACC_BATCH)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACC_ACCUMULATION)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    watched = watch(accelerator, ddp, job="acc-run", agent_socket=sock) if sock else None
    losses: list[float] = []
    eval_s = 0.0
    for i, (xb, yb) in enumerate(loader):
        if i == ACC_STEPS * ACC_ACCUMULATION:
            break
        with accelerator.accumulate(ddp):
            loss = torch.nn.functional.mse_loss(ddp(xb), yb)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(loss.detach()))
        if i % ACC_ACCUMULATION == ACC_ACCUMULATION - 1:
            accelerator.gather(loss.detach())  # the loop's logging, between steps
        if i == 2 * ACC_ACCUMULATION - 1:  # evaluation after optimizer step 2
            started = time.perf_counter()
            ddp.eval()
            with torch.no_grad():
                for _ in range(2):
                    ddp(xb)
            ddp.train()
            eval_s = time.perf_counter() - started
    if watched is not None:
        watched.close()
    return accelerator.unwrap_model(ddp), losses, eval_s


def _acc_rank(rank: int, world: int, sock: str, tmp: str) -> dict[str, Any]:
    bare, bare_losses, _ = _acc_train(rank, None)
    watched, losses, eval_s = _acc_train(rank, sock)
    return {
        "identical": _same_weights(bare, watched) and bare_losses == losses,
        "losses": losses,
        "eval_s": eval_s,
    }


async def test_accelerate_watch(tmp_path: Path) -> None:
    results, db_url = await _run_with_stack(tmp_path, _acc_rank)
    for rank, result in enumerate(results):
        assert result["identical"], rank
    by_rank = _check_steps(db_url, "acc-run", ACC_STEPS, ACC_BATCH * ACC_ACCUMULATION)
    for rank in (0, 1):
        # The step's loss: the mean of those its micro-batches passed to backward.
        micro = results[rank]["losses"]
        expected = [statistics.mean(micro[i : i + 2]) for i in range(0, len(micro), 2)]
        assert [r[3] for r in by_rank[rank]] == pytest.approx(expected, rel=1e-5)
        # The evaluation after step 2 is not input wait before step 3.
        assert results[rank]["eval_s"] >= 2 * EVAL_PASS_S
        after_eval = by_rank[rank][2][2]
        assert after_eval is not None and after_eval < EVAL_PASS_S, after_eval
    _check_straggler(by_rank)
    # The loop's logging gathers, recorded with the step after each and split out of its
    # input wait.
    comm = _rows(
        db_url,
        "SELECT count(*) FROM steps WHERE job = 'acc-run' AND step > 1 "
        "AND between_steps_comm_s > 0",
    )
    assert comm == [(2 * (ACC_STEPS - 1),)], comm
    gathers = _rows(
        db_url,
        "SELECT count(DISTINCT step) FROM collectives WHERE job = 'acc-run' "
        "AND op LIKE 'all_gather%'",
    )
    assert gathers[0][0] >= ACC_STEPS - 1, gathers
    # ... and the straggler detector names it, from the steps the integration delimited.
    named = _rows(
        db_url, "SELECT DISTINCT rank FROM findings WHERE job = 'acc-run' AND kind = 'straggler'"
    )
    assert named == [(1,)], named


def test_the_job_is_named_by_the_caller_then_torshmon_then_the_framework() -> None:
    from torshmon.integrations._common import job_name

    env = {"TORSHMON_JOB": "env-job", "TORCHELASTIC_RUN_ID": "rdzv-7"}
    assert job_name("mine", "hf-run", env) == "mine"
    assert job_name(None, "hf-run", env) == "env-job"
    assert job_name(None, " hf-run ", {"TORCHELASTIC_RUN_ID": "rdzv-7"}) == "hf-run"
    # No run name (HF's default None, a logger-less Lightning): torchrun's id, else default.
    assert job_name(None, None, {"TORCHELASTIC_RUN_ID": "rdzv-7"}) == "rdzv-7"
    assert job_name(None, "", {}) == "default"
    assert len(job_name(None, "r" * 500, {})) == 200  # what the wire takes
