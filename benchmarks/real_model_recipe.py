"""The real-model learning recipe: ``copc train`` / ``copc eval`` overrides shared by the benchmarks.

SmolLM2-135M-Instruct on the shipped word problems (:mod:`copc.tasks.word_problems`) with ``math_tool``,
the worked-example template sent as raw text (``rollout.chat_template=none``: the model continues the
example's pattern; inside its chat template it seldom runs code or boxes an answer), temperature 0.5 (at
1.0 the 135M model's replies are mostly incoherent), budgets sized to the short answers (128 new tokens a
turn, 384 in all, 2 code runs), the reply ending at the next ``Question:`` (``answer_stop``: the model
otherwise invents a next question whose box is graded), async PPO (3a) on the async driver, 40 steps (about
an hour a seed on the whole 2-vCPU machine, docs/own-model.md section 9), checkpoints every 2 steps (so an
interrupted run resumes with ``copc train run_dir=R resume=true``). ``python benchmarks/real_model_recipe.py``
prints the overrides one a line.
"""

from __future__ import annotations

import json

from copc.tasks.word_problems import ANSWER_STOP, TEMPLATE, shipped_paths

TRAIN, EVAL = shipped_paths()

#: Task, data and rollout budgets: what ``copc eval`` needs to score a plain HF folder the same way.
RECIPE = [
    "task=math_tool", f"task_options.data={TRAIN}", f"task_options.eval_data={EVAL}",
    f"task_options.template={json.dumps(TEMPLATE)}", "task_options.max_tool_calls=2",
    f"task_options.answer_stop={json.dumps(ANSWER_STOP)}",
    "rollout.temperature=0.5", "rollout.max_new_tokens_per_turn=128", "rollout.max_total_tokens=384",
    "rollout.context_limit=2048", "rollout.chat_template=none",
]

#: The training run on top of :data:`RECIPE` (``model.policy=`` and ``run_dir=`` are added by the caller).
TRAIN_RECIPE = [
    *RECIPE, "method=async_ppo", "driver.kind=async", "rollout.prompts_per_batch=4", "rollout.group_size=4",
    "trainer.actor_lr=2e-6", "trainer.critic_warmup_steps=0", "steps=40", "checkpoint_every=2",
    "eval.prompts=0", "plots=true",
]

if __name__ == "__main__":
    print("\n".join(TRAIN_RECIPE))
