"""Tasks: prompts + single-use tool environments + rewards, behind one registry.

Built-in (generated, tiny-model sized): ``arith_tool`` (Python tool), ``kv_search`` (BM25 search),
``kv_chain`` (4-8 chained BM25 look-ups: the long-horizon testbed).
Dataset-backed (JSONL / Parquet / HF datasets): ``math_tool`` (fenced Python blocks, math-verify),
``search_qa`` (Search-R1 tags, BM25 over a corpus, exact match).

    task = get_task("arith_tool", seed=0, hard=False)
    prompts = task.prompts("eval", n=200)
    env = task.make_env(prompts[0])
"""

# Importing the task modules registers the tasks.
from copc.tasks import arith_tool, kv_chain, kv_search, math_tool, search_qa  # noqa: F401
from copc.tasks.base import Demo, Segment, SupportsSFT, Task, get_task, task_config_class, task_names

__all__ = ["Demo", "Segment", "SupportsSFT", "Task", "get_task", "task_config_class", "task_names"]
