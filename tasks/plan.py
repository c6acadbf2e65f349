"""Plan a conversion from the checkpoint's headers alone (no JAX, nothing written)."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from tasks.child import child_env, run_json
from tasks.failures import retryable
from tasks.job import Conversion

GIB = 1024**3


@task(name="plan-conversion", task_run_name="plan-{job.slug}", cache_policy=NO_CACHE,
      retries=2, retry_delay_seconds=10, retry_condition_fn=retryable)
def plan_conversion(job: Conversion, timeout_seconds: float = 900) -> dict:
    """Run ``ckptconv plan --json`` in a child: key coverage, shapes, sizes and predicted peak RSS."""
    plan = run_json(["plan", job.source, *job.layout_args(), "--json"], child_env(job.devices), timeout_seconds)
    get_run_logger().info("plan: %s, %d tensors, %.2f GiB out, predicted peak RSS %.2f GiB", plan["family"],
                          plan["tensors"], plan["output_bytes"] / GIB, plan["predicted_peak_rss_bytes"] / GIB)
    return plan
