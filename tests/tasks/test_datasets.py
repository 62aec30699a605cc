"""Dataset-backed tasks on the project's own fixture files: loading, prompts, tool loop, reward, bad rows."""

import json
import pickle
from pathlib import Path

import pytest

from copc.tasks import get_task
from copc.types import StopReason

FIXTURES = Path(__file__).parent.parent / "fixtures"
MATH = str(FIXTURES / "math_tool.jsonl")
QA = str(FIXTURES / "search_qa.jsonl")
CORPUS = str(FIXTURES / "corpus.jsonl")


def test_math_tool_prompts_from_jsonl_with_held_out_eval():
    task = get_task("math_tool", data=MATH, eval_size=2)
    evals, train = task.prompts("eval"), task.prompts("train")
    assert [p.answers for p in evals] == [("210",), ("4096",)]
    assert [p.answers for p in train] == [("6",), ("7",), ("\\frac{3}{4}",)]  # the integer 7 read as text
    assert evals[0].text.startswith("What is the sum of the first 20 positive integers?")
    assert "\\boxed{}" in evals[0].text and "```python" in evals[0].text
    assert task.prompts("train", 1) == train[:1]
    with pytest.raises(ValueError, match="only 3 exist"):
        task.prompts("train", 4)


def test_math_tool_parquet_with_custom_columns():
    pytest.importorskip("pyarrow")
    task = get_task(
        "math_tool", data=str(FIXTURES / "math_tool.parquet"), question_key="question_text",
        answer_key="solution"
    )
    assert [p.answers[0] for p in task.prompts("train")] == ["210", "4096", "6", "7", "\\frac{3}{4}"]


def test_math_tool_episode_fenced_code_then_boxed_answer():
    task = get_task("math_tool", data=MATH, max_tool_calls=2)
    prompt = task.prompts("train")[1]  # 2 ** 12 = 4096
    env = task.make_env(prompt)
    assert env.stop_strings == ("```\n",)
    step = env.step("I will compute it.\n```python\nprint(2**12)\n```\n")
    assert step.observation == "```output\n4096\n```\n" and not step.done
    final = env.step("So the answer is $\\boxed{4096}$.")  # a turn without code is the final answer
    assert final.done and final.reward == 1.0
    wrong = task.make_env(prompt)
    assert wrong.step("The answer is \\boxed{4097}.").reward == 0.0


def test_math_tool_marks_a_final_turn_without_an_answer_as_void():
    """SimpleTIR's void turn for fenced code: a turn that is neither a code block nor a \\boxed{} answer.
    It is still graded on the whole response (an earlier \\boxed{} counts), and marked so that
    trainer.void_turns = mask can leave the episode out of the losses."""
    task = get_task("math_tool", data=MATH, max_tool_calls=2)
    prompt = task.prompts("train")[1]  # 2 ** 12 = 4096
    answered = task.make_env(prompt).step("So \\boxed{4096}.")
    assert answered.info["void_turn"] == 0.0 and answered.reward == 1.0
    env = task.make_env(prompt)
    env.step("I think it is \\boxed{4096}, let me check.\n```python\nprint(2**12)\n```\n")
    void = env.step("Yes.")
    assert void.done and void.info["void_turn"] == 1.0 and void.reward == 1.0


def test_math_tool_error_and_budget_are_observations():
    task = get_task("math_tool", data=MATH, max_tool_calls=1)
    env = task.make_env(task.prompts("train")[0])
    step = env.step("```python\nprint(undefined_name)\n```\n")
    assert "NameError" in step.observation and step.info["tool_errors"] == 1
    over = env.step("```python\nprint(1)\n```\n")
    assert "no tool calls left" in over.observation
    assert env.finish(StopReason.MAX_TURNS).reward == 0.0


def test_math_tool_equivalent_answers_are_accepted():
    task = get_task("math_tool", data=MATH)
    prompt = task.prompts("train")[4]  # gold \frac{3}{4}
    assert task.make_env(prompt).step("Dividing by 6 gives \\boxed{0.75}.").reward == 1.0


def test_bad_rows_name_the_file_row_and_fix(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"problem": "1+1?",
                               "answer": "2"}) + "\n" + json.dumps({"problem": "2+2?"}) + "\n")
    with pytest.raises(ValueError,
                       match=r"bad.jsonl, line 2: column .answer. is missing.*set task_options.answer_key="):
        get_task("math_tool", data=str(bad)).prompts("train")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"problem": "1+1?", "answer": "2"}\n{not json\n')
    with pytest.raises(ValueError, match=r"broken\.jsonl, line 2: not valid JSON"):
        get_task("math_tool", data=str(broken)).prompts("train")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        get_task("math_tool", data=str(tmp_path / "missing.jsonl")).prompts("train")
    with pytest.raises(ValueError, match=r"set task_options\.question_key="):
        get_task("search_qa", data=MATH, corpus=CORPUS).prompts("train")


def test_search_qa_prompts_golds_as_lists():
    task = get_task("search_qa", data=QA, corpus=CORPUS, eval_data=QA)
    prompts = task.prompts("eval")
    assert prompts[0].answers == ("Ostra", "the Ostra river")
    assert prompts[3].answers == ("green",)  # a single string is accepted
    assert "Question: Which river flows through the town of Velmora?" in prompts[0].text
    assert "<search>" in prompts[0].text and "<answer>" in prompts[0].text


def test_search_qa_golds_that_normalise_to_nothing_are_not_graded(tmp_path):
    """A gold of "" or "The" normalises to "" under SQuAD's rules, so an empty answer would equal it: such
    a gold is left out, and a row with no other gold is refused with its place; an empty answer never
    scores (review 14 graded <answer></answer> 1.0 against ["Paris", ""])."""
    rows = tmp_path / "qa.jsonl"
    rows.write_text('{"question": "Capital?", "golden_answers": ["Paris", ""]}\n')
    task = get_task("search_qa", data=str(rows), corpus=CORPUS, eval_data=str(rows))
    (prompt,) = task.prompts("train")
    assert prompt.answers == ("Paris",)
    env = task.make_env(prompt)
    assert env.step("<answer></answer>").reward == 0.0
    rows.write_text('{"question": "Capital?", "golden_answers": ["Paris"]}\n{"question": "Article?", '
                    '"golden_answers": ["The", "a"]}\n')
    with pytest.raises(ValueError, match=r"line 2: every answer in column 'golden_answers' .* is empty after "
                                         r"SQuAD normalisation"):
        get_task("search_qa", data=str(rows), corpus=CORPUS).prompts("train")


def test_search_qa_episode_with_bm25(tmp_path):
    task = get_task("search_qa", data=QA, corpus=CORPUS, top_k=2, index_dir=str(tmp_path / "index"))
    prompt = task.prompts("train")[2]  # Quillan observatory, 1887
    env = task.make_env(prompt)
    assert env.stop_strings == ("</search>", "</answer>")
    step = env.step("<think>I need the opening year.</think><search>Quillan observatory opened</search>")
    assert step.observation.startswith("<information>") and step.observation.endswith("</information>")
    passage = "The Quillan observatory opened in 1887 on a hill above the village of Quillan."
    assert step.observation == f"<information>{passage}</information>"
    # One passage per line, best first; only passages sharing a term with the query come back.
    wide = env.step("<search>Velmora Ostra river</search>").observation
    assert len(wide.splitlines()) == 2 and "Ostra river flows through Velmora" in wide
    final = env.step("<think>It says 1887.</think><answer> 1887. </answer>")
    assert final.done and final.reward == 1.0  # SQuAD normalisation drops punctuation and spaces
    assert final.info["tool_calls"] == 2
    assert (tmp_path / "index").exists()
    reloaded = pickle.loads(pickle.dumps(task))  # a worker process: index loaded from index_dir
    again = reloaded.make_env(prompt).step("<search>Quillan observatory opened</search>")
    assert again.observation == step.observation


def test_search_qa_em_against_any_gold_and_empty_query():
    task = get_task("search_qa", data=QA, corpus=CORPUS)
    prompt = task.prompts("train")[0]
    assert task.make_env(prompt).step("<answer>The Ostra River</answer>").reward == 1.0
    assert task.make_env(prompt).step("<answer>Velmora</answer>").reward == 0.0
    env = task.make_env(prompt)
    step = env.step("<search>   </search>")
    assert "empty query" in step.observation and step.info["tool_errors"] == 1
    void = env.step("<think>hmm</think>")
    assert void.done and void.reward == 0.0 and void.info["void_turn"] == 1.0


def test_row_errors_count_lines_in_the_file_and_refuse_non_text(tmp_path):
    """Issue 18, defect 7: errors counted rows within the split, and true/0.1 became "True"/"0.1"."""
    from copc.tasks.datasets import DataError

    good = json.dumps({"problem": "1+1?", "answer": "2"})
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join([good, good, "", good, json.dumps({"problem": "p", "answer": 0.1})]) + "\n")
    with pytest.raises(DataError, match=r"d\.jsonl, line 5: column 'answer' holds the float 0\.1"):
        get_task("math_tool", data=str(path), eval_size=2).prompts("train")  # row 2 of the train split
    prompts = get_task("math_tool", data=str(path), eval_size=1).prompts("train", 2)
    assert [p.meta["row"] for p in prompts] == [2, 4]  # file lines, blank line 3 skipped
    path.write_bytes(good.encode() + b'\n{"problem": "\xff", "answer": "1"}\n')
    with pytest.raises(DataError, match=r"line 2: not valid UTF-8 \(byte 0xff at column 14\)"):
        get_task("math_tool", data=str(path)).prompts("train")
    path.write_text(good + "\n")
    with pytest.raises(DataError, match="eval_size=1 leaves no train rows"):
        get_task("math_tool", data=str(path), eval_size=1).prompts("train")


def test_eval_prompts_that_are_also_train_prompts_are_counted_at_start(tmp_path, capsys):
    """Nothing de-duplicates across the cut, so a file that repeats a problem (P1 here) or eval_data set to
    the train file makes held-out prompts train prompts: the start-up check says how many."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(f'{{"problem": "{p}", "answer": "1"}}\n' for p in ("P1", "P2", "P1", "P3")))
    get_task("math_tool", data=str(rows), eval_size=1).check_rows()
    assert "warning: math_tool: 1 of 1 eval prompts are also train prompts" in capsys.readouterr().err
    get_task("math_tool", data=str(rows), eval_size=2).check_rows()  # P1, P2 held out; P1 again in train
    assert "1 of 2 eval prompts" in capsys.readouterr().err
    get_task("search_qa", data=QA, corpus=CORPUS, eval_data=QA).check_rows()
    assert "warning: search_qa: 4 of 4 eval prompts are also train prompts" in capsys.readouterr().err
    get_task("math_tool", data=MATH, eval_size=2).check_rows()
    assert capsys.readouterr().err == ""
