"""One tuning session of one job: the event-driven state machine (see the package docstring)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import msgspec
from scipy import stats  # type: ignore[import-untyped]  # scipy ships no type stubs

from torshmon.aggregator.core.tuner.config import (
    TrialConfig,
    TunerError,
)
from torshmon.aggregator.core.tuner.events import (
    Abort,
    ApplyConfig,
    Decision,
    Finish,
    Purpose,
    StepSample,
    Trial,
    TrialDecision,
)
from torshmon.aggregator.core.tuner.prior import Evidence, spread
from torshmon.aggregator.core.tuner.proposals import (
    ask,
    bucket_screen,
    codec_screen,
    random_proposal,
)
from torshmon.aggregator.core.tuner.settings import TunerSettings
from torshmon.aggregator.core.tuner.space import SearchSpace
from torshmon.aggregator.core.tuner.state import (
    STATE_VERSION,
    Pending,
    Phase,
    Segment,
    SessionState,
    Told,
)

if TYPE_CHECKING:
    pass


class TuningSession:
    """One job's tuning session; see the module docstring for the protocol.

    Not thread-safe: one caller drives a session. Every ``on_*`` method returns the
    decision to execute now, or None when there is nothing to do.
    """

    def __init__(
        self,
        space: SearchSpace | None = None,
        settings: TunerSettings | None = None,
        *,
        seed: int = 0,
    ) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
            raise TunerError(f"seed must be an integer in [0, 2**32), got {seed!r}")
        self._s = SessionState(
            space=space if space is not None else SearchSpace(),
            settings=settings if settings is not None else TunerSettings(),
            seed=seed,
        )

    # -- persistence ---------------------------------------------------------------------

    def to_state(self) -> dict[str, Any]:
        """The whole session as a JSON-safe dict (``tuning_sessions.state_blob``)."""
        state: dict[str, Any] = msgspec.json.decode(msgspec.json.encode(self._s))
        return state

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> TuningSession:
        """A session restored from ``to_state``; it decides exactly as the original would.

        After a restart call ``resume(now)`` so that timeouts count from then. Raises
        TunerError for a blob of another version or shape.
        """
        if state.get("v") != STATE_VERSION:
            raise TunerError(
                f"tuner state version {state.get('v')!r} is not supported; "
                f"this tuner reads version {STATE_VERSION}"
            )
        try:
            restored = msgspec.convert(dict(state), SessionState)
        except (msgspec.ValidationError, ValueError) as exc:
            raise TunerError(f"invalid tuner state: {exc}") from exc
        session = cls.__new__(cls)
        session._s = restored
        return session

    def resume(self, now: float) -> None:
        """Restart the running timeout from ``now`` (after a restore in a new process:
        acknowledgements and steps may have been queued while nobody listened)."""
        s = self._s
        if s.phase == "applying":
            s.deadline_unix_s = now + s.settings.apply_timeout_s
        elif s.phase == "measuring":
            s.deadline_unix_s = now + s.settings.step_timeout_s

    # -- read-only views -----------------------------------------------------------------

    @property
    def phase(self) -> Phase:
        """``created``, ``applying``, ``measuring``, ``finished`` or ``aborted``."""
        return self._s.phase

    @property
    def done(self) -> bool:
        return self._s.phase in ("finished", "aborted")

    @property
    def trials(self) -> tuple[Trial, ...]:
        return tuple(self._s.trials)

    @property
    def baseline(self) -> TrialConfig | None:
        return self._s.baseline

    @property
    def best(self) -> Trial | None:
        """The incumbent: the best kept trial so far (the baseline at first)."""
        return self._s.trials[self._s.incumbent] if self._s.trials else None

    @property
    def best_score(self) -> float | None:
        """The score the session stands by: once finished, the verified score if the
        best config was kept, else the baseline's; before that, the incumbent's."""
        trials = self._s.trials
        if self._s.phase == "finished":
            verify = trials[-1] if trials and trials[-1].kind == "verify" else None
            if verify is not None and verify.decision == "kept":
                return verify.score
            return trials[0].score if trials else None
        best = self.best
        return best.score if best is not None else None

    @property
    def unit(self) -> str:
        """``samples/s`` or ``steps/s``; empty before the first measured step."""
        return self._s.unit

    @property
    def deadline_unix_s(self) -> float | None:
        """When ``on_timeout`` should be called next (None: no timer needed)."""
        return self._s.deadline_unix_s

    @property
    def reason(self) -> str:
        """Why the session ended as it did (empty while it runs)."""
        return self._s.reason

    @property
    def final_config(self) -> TrialConfig | None:
        return self._s.final_config

    @property
    def pending(self) -> ApplyConfig | None:
        """The ApplyConfig awaiting its acknowledgement, if any (e.g. after a restore)."""
        p = self._s.pending
        if p is None or self._s.phase != "applying":
            return None
        return ApplyConfig(p.config, "awaiting acknowledgement", p.purpose, p.trial_index)

    def summary(self) -> str:
        """One line for people (Slack): what changed and what it gained."""
        s = self._s
        if s.summary:
            return s.summary
        if s.phase == "aborted":
            return f"tuning aborted: {s.reason}"
        done = sum(1 for t in s.trials if t.kind != "verify" and t.decision is not None)
        return f"tuning in progress: {done} of {s.settings.max_trials} trials measured"

    # -- events --------------------------------------------------------------------------

    def start(
        self, now: float, baseline_config: TrialConfig, *, link_bytes_per_s: float | None = None
    ) -> Decision:
        """Begin: re-apply the job's own config and measure it as the baseline.

        ``link_bytes_per_s``: the job's slowest link as its latest link check measured
        it (None: not measured); with what the baseline shows, the prior's evidence.
        TunerError if the session was already started or the bandwidth is not positive.
        """
        s = self._s
        if s.phase != "created":
            raise TunerError(f"the session has already started (phase {s.phase!r})")
        if link_bytes_per_s is not None and not (
            math.isfinite(link_bytes_per_s) and link_bytes_per_s > 0
        ):
            raise TunerError(f"link_bytes_per_s must be > 0, got {link_bytes_per_s!r}")
        s.started_unix_s = now
        s.baseline = s.current = baseline_config
        s.link_bytes_per_s = link_bytes_per_s
        s.trials.append(Trial(0, "baseline", baseline_config, now))
        return self._apply(now, baseline_config, "baseline", 0, "measure the job's own config")

    @property
    def wants_link(self) -> bool:
        """Whether a link reading would still reach the prior: none yet, and the baseline
        (after which the prior reads its evidence) is not over."""
        s = self._s
        over = s.phase in ("finished", "aborted")
        return s.link_bytes_per_s is None and len(s.trials) <= 1 and not over

    def observe_link(self, link_bytes_per_s: float | None) -> None:
        """A link reading that came while the baseline was measured (the job's first link
        check often ends its warm-up, after a session began): the prior takes it. Ignored
        once the prior has read its evidence, or when not a positive bandwidth."""
        if (
            self.wants_link
            and link_bytes_per_s is not None
            and math.isfinite(link_bytes_per_s)
            and link_bytes_per_s > 0
        ):
            self._s.link_bytes_per_s = link_bytes_per_s

    def on_applied(self, version: int, effective_step: int, now: float) -> Decision | None:
        """The awaited config was applied by all ranks from ``effective_step`` on, as
        config ``version``. Ignored when nothing is awaited."""
        s = self._s
        if s.phase != "applying" or s.pending is None:
            return None
        pending, s.pending = s.pending, None
        s.current = pending.config
        s.failures = 0
        if pending.purpose == "rollback":
            return self._next(now)
        if pending.purpose == "restore":
            return self._finish(now)
        index = pending.trial_index
        if index is None:  # pragma: no cover - every measuring purpose carries one
            raise TunerError("internal: a measured config without a trial index")
        s.trials[index] = replace(s.trials[index], version=version, started_unix_s=now)
        self._measure(now, version, effective_step + s.settings.warmup_steps)
        return None

    def on_rejected(self, reason: str, now: float) -> Decision | None:
        """The awaited config was refused (or its command expired); ``reason`` says why.
        Ignored when nothing is awaited."""
        s = self._s
        if s.phase != "applying" or s.pending is None:
            return None
        pending, s.pending = s.pending, None
        s.failures += 1
        target = pending.config.describe()
        if pending.purpose == "baseline":
            self._close_trial(now, 0, "failed", f"refused: {reason}")
            return self._abort(now, f"the job refused its own config ({reason})", None)
        if pending.purpose in ("rollback", "restore"):
            return self._abort(
                now, f"could not go back to {target}: {reason}", restore=pending.config
            )
        index = pending.trial_index
        if index is None:  # pragma: no cover - every measuring purpose carries one
            raise TunerError("internal: a measured config without a trial index")
        if pending.purpose == "verify":
            self._close_trial(now, index, "failed", f"refused: {reason}")
            return self._restore_baseline(now, f"the best config was refused ({reason})")
        self._close_trial(now, index, "failed", f"refused: {reason}")
        self._tell(pending.config, None)
        if s.failures >= s.settings.max_failures:
            return self._conclude(now, f"{s.failures} configs in a row were refused")
        return self._next(now)

    def on_timeout(self, now: float) -> Decision | None:
        """The caller's timer: acts only when ``deadline_unix_s`` has passed.

        No acknowledgement in time counts as a refusal; no steps in time while
        measuring aborts the session (the job stopped or stalled)."""
        s = self._s
        if s.deadline_unix_s is None or now < s.deadline_unix_s:
            return None
        if s.phase == "applying":
            return self.on_rejected(
                f"no acknowledgement within {s.settings.apply_timeout_s:g} s", now
            )
        if s.phase == "measuring":
            return self._abort(
                now,
                f"the job sent no step for {s.settings.step_timeout_s:g} s",
                restore=self._incumbent_config(),
            )
        return None

    def abort(self, reason: str, now: float) -> Abort:
        """Stop now (job ended, user cancelled); ``restore_config`` says what to push."""
        if self.done:
            return Abort(reason=self._s.reason)
        return self._abort(now, reason, restore=self._incumbent_config())

    def on_step(self, sample: StepSample, now: float) -> Decision | None:
        """One of rank 0's steps. Steps of other config versions, repeated or older
        steps, and warm-up steps are ignored."""
        s = self._s
        seg = s.segment
        if s.phase != "measuring" or seg is None or sample.config_version != seg.version:
            return None
        if sample.step <= seg.last_step:
            return None
        seg.last_step = sample.step
        s.deadline_unix_s = now + s.settings.step_timeout_s
        if sample.step < seg.first_step:
            return None
        if sample.loss_nonfinite or (sample.loss is not None and not math.isfinite(sample.loss)):
            return self._guard_failed(now, "rejected_loss", "the loss became non-finite")
        rate = sample.rate()
        if rate is None:
            return None
        if not s.unit:
            s.unit = rate[1]
        if self._active().kind == "baseline":
            self._observe_baseline(sample)
        seg.rates.append(rate[0])
        if sample.loss is not None:
            seg.losses.append(sample.loss)
        if sample.relative_errors:
            seg.errors.append(max(sample.relative_errors))
            verdict = self._error_verdict()
            if verdict is not None:
                return self._guard_failed(now, "rejected_error", verdict)
        if len(seg.rates) < s.settings.window_steps:
            return None
        return self._close_window(now)

    # -- measuring -----------------------------------------------------------------------

    def _observe_baseline(self, sample: StepSample) -> None:
        """Keep what the prior reads from the baseline's measured steps."""
        s = self._s
        ratio = sample.communication_ratio()
        if ratio is not None:
            s.comm_ratios.append(ratio)
        if sample.bucket_count is not None:
            s.bucket_count = sample.bucket_count

    def evidence(self) -> Evidence:
        """What the job has told the prior so far (complete once the baseline is measured)."""
        s = self._s
        losses = s.trials[0].loss_windows if s.trials else ()
        return Evidence(
            link_bytes_per_s=s.link_bytes_per_s,
            communication_ratio=statistics.median(s.comm_ratios) if s.comm_ratios else None,
            bucket_count=s.bucket_count,
            loss_spread=spread(losses),
        )

    def _measure(self, now: float, version: int, first_step: int) -> None:
        s = self._s
        s.phase = "measuring"
        s.segment = Segment(version=version, first_step=first_step)
        s.deadline_unix_s = now + s.settings.step_timeout_s

    def _active(self) -> Trial:
        return self._s.trials[-1]

    def _close_window(self, now: float) -> Decision | None:
        s = self._s
        seg = s.segment
        if seg is None:  # pragma: no cover - only called while measuring
            raise TunerError("internal: no segment")
        # Total samples over total time: the harmonic mean of per-step throughputs.
        throughput = len(seg.rates) / sum(1.0 / r for r in seg.rates)
        trial = self._active()
        loss_windows = trial.loss_windows
        if seg.losses:
            loss_windows = (*loss_windows, statistics.median(seg.losses))
        trial = replace(trial, windows=(*trial.windows, throughput), loss_windows=loss_windows)
        trial = replace(trial, score=statistics.median(trial.windows))
        s.trials[trial.index] = trial
        seg.rates.clear()
        seg.losses.clear()
        count = len(trial.windows)
        if trial.kind == "baseline":
            return self._end_baseline(now) if count >= s.settings.windows else None
        if count < s.settings.min_windows:
            return None
        loss_verdict = self._loss_verdict(trial)
        if loss_verdict is not None:
            return self._guard_failed(now, "rejected_loss", loss_verdict)
        reference = s.trials[0] if trial.kind == "verify" else s.trials[s.incumbent]
        p_more, p_less, ratio = self._compare(trial.windows, reference.windows)
        if p_less < s.settings.alpha and ratio <= 1 - s.settings.min_improvement:
            change = f"{ratio - 1:+.1%} vs {self._name(reference)} (p={p_less:.3g})"
            return self._regressed(now, trial, p_less, change)
        if count < s.settings.windows:
            return None
        change = f"{ratio - 1:+.1%} vs {self._name(reference)} (p={p_more:.3g})"
        if p_more < s.settings.alpha and ratio >= 1 + s.settings.min_improvement:
            return self._improved(now, trial, p_more, change)
        return self._unchanged(now, trial, p_more, change)

    def _compare(
        self, windows: Sequence[float], reference: Sequence[float]
    ) -> tuple[float, float, float]:
        """(p greater, p less, median ratio) of ``windows`` against ``reference``."""
        greater = float(stats.mannwhitneyu(windows, reference, alternative="greater").pvalue)
        less = float(stats.mannwhitneyu(windows, reference, alternative="less").pvalue)
        ratio = statistics.median(windows) / statistics.median(reference)
        return greater, less, ratio

    def _error_verdict(self) -> str | None:
        s, seg = self._s, self._s.segment
        trial = self._active()
        if seg is None or trial.kind == "baseline":
            return None  # the job's own codec is the user's choice, not ours to reject
        error = statistics.median(seg.errors)
        s.trials[trial.index] = replace(trial, relative_error=error)
        bound = s.settings.max_relative_error.get(trial.config.codec)
        if bound is None or len(seg.errors) < s.settings.min_error_samples or error <= bound:
            return None
        return f"relative error {error:.3g} exceeds the {trial.config.codec} bound {bound:g}"

    def _loss_verdict(self, trial: Trial) -> str | None:
        """Why the loss after the switch is worse than just before it, if it is."""
        s = self._s
        reference = s.loss_reference
        if len(trial.loss_windows) < s.settings.min_windows or len(reference) < 2:
            return None
        before, after = statistics.median(reference), statistics.median(trial.loss_windows)
        rise = after - before
        if rise <= s.settings.loss_degradation * abs(before):
            return None
        p = float(stats.mannwhitneyu(trial.loss_windows, reference, alternative="greater").pvalue)
        if p >= s.settings.alpha:
            return None
        return (
            f"loss rose from {before:.4g} to {after:.4g} after the switch "
            f"({rise / abs(before) if before else math.inf:+.0%}, p={p:.3g})"
        )

    # -- decisions on a trial ------------------------------------------------------------

    def _end_baseline(self, now: float) -> Decision | None:
        s = self._s
        trial = self._active()
        self._close_trial(now, 0, "kept", "baseline")
        s.incumbent = 0
        s.loss_reference = list(trial.loss_windows)
        s.measured.append(trial.config)
        self._tell(trial.config, trial.score)
        if s.settings.proposer == "tpe" and s.baseline is not None:
            evidence = self.evidence()
            s.evidence = evidence.describe()
            s.screen = codec_screen(s.space, s.settings, s.baseline, evidence)
        return self._next(now)

    def _improved(self, now: float, trial: Trial, p: float, change: str) -> Decision | None:
        s = self._s
        self._close_trial(now, trial.index, "kept", change, p)
        s.loss_reference = list(trial.loss_windows)
        if trial.kind == "verify":
            return self._finish(now)
        s.incumbent = trial.index
        self._tell(trial.config, trial.score)
        return self._next(now)

    def _unchanged(self, now: float, trial: Trial, p: float, change: str) -> Decision | None:
        s = self._s
        if trial.kind == "verify":
            self._close_trial(now, trial.index, "rolled_back", f"not better: {change}", p)
            return self._restore_baseline(now, "the best config was not better on verification")
        self._close_trial(now, trial.index, "not_better", change, p)
        s.loss_reference = list(trial.loss_windows)
        self._tell(trial.config, trial.score)
        return self._next(now)

    def _regressed(self, now: float, trial: Trial, p: float, change: str) -> Decision | None:
        if trial.kind == "verify":
            self._close_trial(now, trial.index, "rolled_back", f"worse: {change}", p)
            return self._restore_baseline(now, "the best config was worse on verification")
        self._close_trial(now, trial.index, "worse", change, p)
        self._s.loss_reference = list(trial.loss_windows)
        self._tell(trial.config, trial.score)
        return self._rollback(now, f"trial {trial.index} was worse: {change}")

    def _guard_failed(self, now: float, decision: TrialDecision, why: str) -> Decision | None:
        s = self._s
        trial = self._active()
        if trial.kind == "baseline":
            return self._abort(now, f"the baseline itself fails a guardrail: {why}", None)
        if trial.kind == "verify":
            self._close_trial(now, trial.index, "rolled_back", why)
            return self._restore_baseline(now, f"the best config failed verification: {why}")
        self._close_trial(now, trial.index, decision, why)
        if decision == "rejected_loss":
            # The harm may outlast the rollback: judge the next switch on its own loss.
            s.loss_reference = []
        s.banned.append(trial.config.choice.label)
        self._tell(trial.config, None)
        return self._rollback(now, f"trial {trial.index} {decision.replace('_', ' ')}: {why}")

    def _close_trial(
        self, now: float, index: int, decision: TrialDecision, reason: str, p: float | None = None
    ) -> None:
        s = self._s
        trial = s.trials[index]
        s.trials[index] = replace(
            trial, decision=decision, reason=reason, p_value=p, ended_unix_s=now
        )
        s.segment = None
        if trial.kind != "verify" and trial.windows and decision != "failed":
            s.measured.append(trial.config)

    # -- what comes next -----------------------------------------------------------------

    def _next(self, now: float) -> Decision | None:
        s = self._s
        measured = sum(1 for t in s.trials if t.kind != "verify")
        if measured >= s.settings.max_trials:
            return self._conclude(now, f"the trial limit ({s.settings.max_trials}) reached")
        config = self._propose()
        if config is None:
            return self._conclude(now, "the optimiser converged")
        index = len(s.trials)
        s.trials.append(Trial(index, "trial", config, now))
        reason = f"trial {index}: {config.describe()}"
        if index == 1 and s.evidence:
            reason += f" (the job told: {s.evidence})"  # what the first proposals rest on
        return self._apply(now, config, "trial", index, reason)

    def _rollback(self, now: float, why: str) -> Decision | None:
        incumbent = self._s.trials[self._s.incumbent].config
        return self._apply(now, incumbent, "rollback", None, f"roll back: {why}")

    def _conclude(self, now: float, why: str) -> Decision | None:
        """End the search: verify the best config, or make sure the baseline runs."""
        s = self._s
        s.reason = why
        best = s.trials[s.incumbent]
        if s.incumbent == 0:
            return self._restore_baseline(now, f"{why}; no config beat the baseline")
        index = len(s.trials)
        s.trials.append(Trial(index, "verify", best.config, now))
        reason = f"{why}; verify the best config, {best.config.describe()}"
        # Applied again even when the job runs it already: the acknowledgement gives a
        # clean step to measure from, and the probe keeps its buckets when caps are equal.
        return self._apply(now, best.config, "verify", index, reason)

    def _restore_baseline(self, now: float, why: str) -> Decision | None:
        s = self._s
        s.reason = why
        s.incumbent = 0
        if s.baseline is None:  # pragma: no cover - set by start()
            raise TunerError("internal: no baseline")
        if s.current is not None and s.current.key() == s.baseline.key():
            return self._finish(now)
        return self._apply(now, s.baseline, "restore", None, f"restore the baseline: {why}")

    def _apply(
        self, now: float, config: TrialConfig, purpose: Purpose, index: int | None, reason: str
    ) -> ApplyConfig:
        s = self._s
        s.phase = "applying"
        s.segment = None
        s.pending = Pending(config, purpose, index)
        s.deadline_unix_s = now + s.settings.apply_timeout_s
        return ApplyConfig(config, reason, purpose, index)

    def _finish(self, now: float) -> Finish:
        s = self._s
        if s.baseline is None:  # pragma: no cover - set by start()
            raise TunerError("internal: no baseline")
        verify = s.trials[-1] if s.trials[-1].kind == "verify" else None
        changed = verify is not None and verify.decision == "kept"
        final = verify.config if changed and verify is not None else s.baseline
        s.phase = "finished"
        s.final_config = final
        s.deadline_unix_s = None
        s.ended_unix_s = now
        s.summary = self._summarise(changed, verify)
        baseline_score = s.trials[0].score
        best_score = verify.score if changed and verify is not None else baseline_score
        return Finish(final, s.summary, s.reason, baseline_score, best_score, changed)

    def _abort(self, now: float, reason: str, restore: TrialConfig | None) -> Abort:
        s = self._s
        if restore is not None and s.current is not None and s.current.key() == restore.key():
            restore = None
        s.phase = "aborted"
        s.reason = reason
        s.pending = None
        s.segment = None
        s.deadline_unix_s = None
        s.ended_unix_s = now
        for trial in s.trials:
            if trial.decision is None:
                self._close_trial(now, trial.index, "failed", f"session aborted: {reason}")
        return Abort(reason, restore)

    def _incumbent_config(self) -> TrialConfig | None:
        s = self._s
        return s.trials[s.incumbent].config if s.trials else s.baseline

    # -- the optimiser -------------------------------------------------------------------

    def _propose(self) -> TrialConfig | None:
        """The next config to measure; None once the optimiser only repeats itself."""
        s = self._s
        if s.baseline is None:  # pragma: no cover - set by start()
            raise TunerError("internal: no baseline")
        if s.settings.proposer == "random":
            return random_proposal(s.space, s.baseline, s.seed, len(s.told), self._known)
        while s.screen or not s.bucket_screened:
            if not s.screen:
                s.bucket_screened = True
                s.screen = bucket_screen(
                    s.space, s.settings, s.trials[s.incumbent].config, s.baseline, self.evidence()
                )
                continue
            config = s.screen.pop(0)
            if not self._known(config):
                return config
        while s.repeats < s.settings.max_repeats:
            config = s.space.config_for(ask(s.space, s.settings, s.seed, s.told), s.baseline)
            if not self._known(config):
                s.repeats = 0
                return config
            # Tell the optimiser what it already knows, so it moves on.
            s.repeats += 1
            self._tell(config, self._known_value(config))
        return None

    def _known(self, config: TrialConfig) -> bool:
        s = self._s
        key = config.key()
        return (
            config.choice.label in s.banned
            or any(m.key() == key for m in s.measured)
            or any(t.config.key() == key and t.decision == "failed" for t in s.trials)
        )

    def _known_value(self, config: TrialConfig) -> float | None:
        key = config.key()
        if config.choice.label in self._s.banned:
            return None
        for trial in reversed(self._s.trials):
            if trial.config.key() == key and trial.kind != "verify":
                return trial.score if trial.decision not in ("failed",) else None
        return None

    def _tell(self, config: TrialConfig, value: float | None) -> None:
        params = self._s.space.params_for(config)
        if params is not None:
            self._s.told.append(Told(params, value))

    # -- words ---------------------------------------------------------------------------

    def _name(self, trial: Trial) -> str:
        return "the baseline" if trial.index == 0 else f"trial {trial.index}"

    def _summarise(self, changed: bool, verify: Trial | None) -> str:
        s = self._s
        base = s.trials[0]
        if s.baseline is None:  # pragma: no cover - set by start()
            raise TunerError("internal: no baseline")
        # One count, the one max_trials limits: every measured config, the baseline too.
        measured = sum(1 for t in s.trials if t.kind != "verify" and t.decision != "failed")
        trials = f"{measured} trials done, the baseline included"
        losses = any(t.loss_windows for t in s.trials)
        if changed and verify is not None and verify.score and base.score:
            parts = []
            old, new = s.baseline, verify.config
            if old.bucket_label != new.bucket_label:
                parts.append(
                    f"bucket {old.bucket_label.removesuffix(' MB')} -> {new.bucket_label}"
                    if old.first_bucket_cap_mb == old.bucket_cap_mb
                    else f"bucket {old.bucket_label} -> {new.bucket_label}"
                )
            if old.choice.label != new.choice.label:
                parts.append(f"codec {old.choice.label} -> {new.choice.label}")
            gain = verify.score / base.score - 1
            loss = "loss unaffected" if losses else "loss not reported"
            return (
                f"{', '.join(parts)}: {gain:+.0%} {s.unit} "
                f"({base.score:.4g} -> {verify.score:.4g}), {loss}; {trials}"
            )
        best = max(
            (t for t in s.trials if t.kind == "trial" and t.score is not None),
            key=lambda t: t.score or 0.0,
            default=None,
        )
        tried = ""
        if best is not None and best.score and base.score:
            tried = f"; best tried {best.config.describe()} at {best.score / base.score - 1:+.0%}"
        return f"left unchanged ({s.baseline.describe()}): {s.reason}{tried}; {trials}"
