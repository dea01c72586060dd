"""Hooks that report and watch: metrics in the log, ``/get_server_info`` and Prometheus; at idle, the worker's
health, the score dump and the integrity check."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch

from vtoken_sglang.debug_switches import SWITCHES
from vtoken_sglang.integration.observe.hook_timer import TIMER
from vtoken_sglang.integration.observe.host_reads import HOST_READS
from vtoken_sglang.integration.observe.metrics_export import PrometheusExporter, log_line
from vtoken_sglang.integration.observe.runtime_metrics import metrics
from vtoken_sglang.integration.process import SchedulerProcess

if TYPE_CHECKING:
    from vtoken_sglang.integration.runtime import VTokenRuntime

logger = logging.getLogger("vtoken_sglang")


def settle_at_idle(vt: SchedulerProcess, original, scheduler, *args, **kwargs):
    """AROUND ``Scheduler.on_idle``. Before it, when the scheduler is fully idle: free the relocation sources still
    pending (SGLang's idle leak check runs inside). After it: log this rank's metrics once per burst of work (TP
    ranks are compared by it), bring the Prometheus series to their idle values, let the compaction worker's client
    check its health, write the score dump, and (fully idle) run the integrity check."""
    rt = vt.runtime
    if rt is None:
        return original(scheduler, *args, **kwargs)
    fully_idle = scheduler.is_fully_idle()  # on_idle itself neither admits nor runs anything
    if fully_idle:
        rt.release_before_idle()
    result = original(scheduler, *args, **kwargs)
    _after_idle(rt, fully_idle)
    return result


def _after_idle(rt: VTokenRuntime, fully_idle: bool) -> None:
    if rt.stats.rounds != rt.logged_rounds:
        from sglang.srt.runtime_context import get_parallel

        rt.logged_rounds = rt.stats.rounds
        m = metrics(rt)
        logger.info("[vtoken] idle tp_rank=%d %s", get_parallel().tp_rank, m)
        if rt.exporter is not None:
            rt.exporter.update(m)
    rt.plans.poll()
    dump = rt.scores.dump if rt.scores is not None else None
    if dump:
        path = SWITCHES.score_dump
        torch.save(dump, path + ".tmp")
        os.replace(path + ".tmp", path)  # readers never see a partial file
        dump.clear()  # each idle writes the steps since the last one
    if fully_idle:
        rt.integrity.at_idle()


def log_decode_metrics(vt: SchedulerProcess, result, reporter, *args, **kwargs) -> None:
    """AFTER ``SchedulerMetricsReporter.report_decode_stats``: at the same cadence as SGLang's periodic decode
    log line (``--decode-log-interval``), a ``[vtoken]`` line beside it on the logging rank (with a policy that
    evicts), and the Prometheus series when metrics are enabled for this scheduler."""
    rt = vt.runtime
    if rt is None or reporter.forward_ct_decode % reporter.decode_log_interval != 0:
        return
    if not (reporter.is_stats_logging_rank or reporter.current_scheduler_metrics_enabled):
        return
    if rt.policy is None and not reporter.current_scheduler_metrics_enabled:
        return  # policy none evicts nothing: the line would repeat figures SGLang's own line has
    m = metrics(rt)
    if reporter.is_stats_logging_rank:
        logger.info(log_line(m))
    if reporter.current_scheduler_metrics_enabled:
        if rt.exporter is None:
            rt.exporter = PrometheusExporter(reporter.metrics_collector.labels)
        rt.exporter.update(m)


def add_server_info(vt: SchedulerProcess, result, scheduler, *args, **kwargs):
    """AFTER ``Scheduler.get_internal_state``: vToken's metrics under ``"vtoken"`` (``/get_server_info`` shows
    them in ``internal_states``), with ``hook_ms`` per hook (not in the log lines: one entry per hook)."""
    rt = vt.runtime
    if rt is not None and isinstance(getattr(result, "internal_state", None), dict):
        result.internal_state["vtoken"] = {
            **metrics(rt),
            "hook_ms_by_hook": {k: round(v, 3) for k, v in TIMER.by_hook.items()},
            **(
                {"host_reads_by_hook": {k: dict(v) for k, v in HOST_READS.by_hook.items()}}
                if HOST_READS.enabled
                else {}
            ),
        }
    return result
