"""Registry, configs and the tag parsing shared by every task."""

import pickle

import pytest

from copc.tasks import get_task, task_config_class, task_names
from copc.tasks.base import register_task
from copc.tasks.envs import PYTHON_FENCES, PYTHON_TAGS, SEARCH_TAGS


def test_registry_lists_all_tasks():
    assert task_names() == ("arith_tool", "kv_chain", "kv_search", "math_tool", "search_qa")


def test_unknown_task_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown task 'arith'.*valid: arith_tool, kv_chain, kv_search, "
                                         r"math_tool, search_qa"):
        get_task("arith")


def test_unknown_config_field_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown key 'difficuty'.*did you mean 'difficulty'"):
        get_task("arith_tool", difficuty=3)


def test_duplicate_registration_is_rejected():
    with pytest.raises(ValueError, match="duplicate task 'arith_tool': already registered"):
        register_task("arith_tool", task_config_class("arith_tool"))(object)


@pytest.mark.parametrize(
    ("name", "fields", "message"),
    [
        ("arith_tool", {"difficulty": 7}, "difficulty must be one of"),
        ("arith_tool", {"max_output_chars": 10}, "max_output_chars must be >= 64"),
        ("arith_tool", {"sft_tool_frac": 1.5}, r"sft_tool_frac must be in \[0, 1\]"),
        ("kv_search", {"top_k": 0}, "top_k must be > 0"),
        ("kv_search", {"eval_size": 5000}, "over half the question pool"),
        ("math_tool", {}, "data is empty"),
        ("search_qa", {"data": "x.jsonl"}, "corpus is empty"),
    ],
)
def test_bad_configs_fail_with_a_fix(name, fields, message):
    with pytest.raises(ValueError, match=message):
        get_task(name, **fields)


def test_tasks_pickle_without_their_caches():
    task = get_task("arith_tool", eval_size=20, train_size=50)
    task.prompts("eval")
    clone = pickle.loads(pickle.dumps(task))
    assert clone.config == task.config
    assert clone.prompts("eval") == task.prompts("eval")


def test_trailing_call_and_answer_parsing():
    assert PYTHON_TAGS.trailing_call("think <python>print(1)</python>") == "print(1)"
    assert PYTHON_TAGS.trailing_call("<python>print(1)</python> more") is None
    assert PYTHON_TAGS.trailing_call("print(1)</python>") is None
    assert PYTHON_TAGS.answer("<answer>1</answer> <answer> 42 </answer>") == " 42 "
    assert PYTHON_TAGS.answer("<answer>42") is None
    assert PYTHON_TAGS.stop_strings == ("</python>", "</answer>")
    assert SEARCH_TAGS.stop_strings == ("</search>", "</answer>")
    # Fences: the opening fence must not end the turn, the closing one (plus newline) does.
    assert PYTHON_FENCES.stop_strings == ("```\n",)
    assert "```\n" not in "```python\n"
    assert PYTHON_FENCES.trailing_call(
        "Let me compute.\n```python\nprint(2**10)\n```\n") == "\nprint(2**10)\n"
    assert PYTHON_FENCES.answer("\\boxed{3}") is None
