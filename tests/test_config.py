"""Config machinery: dict/YAML round trips, overrides, type checks and one-line errors."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import pytest

from copc.config import ConfigError, ConfigValue, apply_overrides, dump_yaml, from_dict, load_yaml, to_dict
from copc.types import StopReason


@dataclass(frozen=True)
class OptimCfg:
    lr: float = 1e-5
    """Learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}; try 1e-5")


@dataclass(frozen=True)
class StaleCfg:
    mode: Literal["fixed_lag", "bounded"] = "bounded"
    """Staleness policy."""
    staleness: int = 8
    """Lag bound."""

    def __post_init__(self) -> None:
        if self.staleness < 0:
            raise ValueError(
                f"staleness must be >= 0, got {self.staleness};\n use 0 for synchronous training"
            )


@dataclass(frozen=True)
class RootCfg:
    INFINITE_OK: ClassVar[tuple[str, ...]] = ("window",)  # inf = no window
    method: Literal["ppo", "copc"] = "copc"
    """Preset."""
    seed: int = 0
    """Seed."""
    verbose: bool = False
    """Chatty logs."""
    window: float | None = None
    """Optional window."""
    tags: tuple[str, ...] = ()
    """Free tags."""
    weights: dict[str, float] = field(default_factory=dict)
    """Named weights."""
    optim: OptimCfg = field(default_factory=OptimCfg)
    """Optimizer section."""
    staleness: StaleCfg = field(default_factory=StaleCfg)
    """Staleness section."""


def test_defaults_and_round_trip(tmp_path):
    cfg = RootCfg(window=math.inf, tags=("a", "b"), weights={"x": 0.5})
    assert from_dict(RootCfg, to_dict(cfg)) == cfg
    path = dump_yaml(cfg, tmp_path / "c.yaml")
    assert load_yaml(RootCfg, path) == cfg
    assert from_dict(RootCfg, None) == RootCfg()
    assert to_dict(cfg)["optim"] == {"lr": 1e-5, "betas": [0.9, 0.999]}


def test_partial_nested_section_keeps_other_defaults():
    cfg = from_dict(RootCfg, {"staleness": {"staleness": 16}})
    assert cfg.staleness == StaleCfg(mode="bounded", staleness=16)
    assert cfg.optim == OptimCfg()


def test_overrides_parse_and_type_check():
    cfg = apply_overrides(
        RootCfg(),
        [
            "optim.lr=1e-4",  # YAML 1.1 reads 1e-4 as a string; parse_override makes it a number
            "staleness.mode=fixed_lag",
            "seed=3",
            "verbose=true",
            "window=inf",
            "tags=[x, y]",
            "optim.betas=[0.8, 0.9]",
            "weights={a: 1}",
        ],
    )
    assert cfg.optim.lr == pytest.approx(1e-4)
    assert cfg.staleness.mode == "fixed_lag"
    assert cfg.seed == 3 and cfg.verbose is True
    assert cfg.window == math.inf
    assert cfg.tags == ("x", "y")
    assert cfg.optim.betas == (0.8, 0.9)
    assert cfg.weights == {"a": 1.0} and isinstance(cfg.weights["a"], float)
    assert apply_overrides(cfg, ["window=null"]).window is None
    # a whole section as a mapping merges over the current values
    merged = apply_overrides(cfg, ["staleness={staleness: 12}"])
    assert merged.staleness == StaleCfg(mode="fixed_lag", staleness=12)


def _one_line(err: pytest.ExceptionInfo[ConfigError]) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


def test_unknown_key_names_section_valid_keys_and_hint():
    with pytest.raises(ConfigError) as err:
        from_dict(RootCfg, {"optim": {"lrr": 1.0}})
    text = _one_line(err)
    assert "'lrr'" in text and "section 'optim'" in text and "did you mean 'lr'" in text
    assert "valid keys: lr, betas" in text
    with pytest.raises(ConfigError) as err:
        apply_overrides(RootCfg(), ["methd=ppo"])
    text = _one_line(err)
    assert "top-level" in text and "did you mean 'method'" in text


def test_literal_lists_choices():
    with pytest.raises(ConfigError) as err:
        apply_overrides(RootCfg(), ["method=grpo"])
    text = _one_line(err)
    assert "'grpo'" in text and "'ppo', 'copc'" in text


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("seed=1.5", "expected an integer"),
        ("seed=true", "expected an integer"),
        ("verbose=1", "expected true or false"),
        ("optim.lr=fast", "expected a number"),
        ("optim.betas=[0.9]", "expected 2 items"),
        ("tags=3", "expected a list"),
        ("optim=3", "expected a mapping"),
        ("optim.lr.x=1", "is a value, not a section"),
        ("seed", "must look like key.sub=value"),
    ],
)
def test_wrong_types_fail_in_one_line(override, fragment):
    with pytest.raises(ConfigError) as err:
        apply_overrides(RootCfg(), [override])
    assert fragment in _one_line(err)


def test_post_init_range_error_is_surfaced_in_one_line():
    with pytest.raises(ConfigError) as err:
        apply_overrides(RootCfg(), ["staleness.staleness=-1"])
    text = _one_line(err)
    assert "staleness must be >= 0" in text and "use 0 for synchronous" in text
    with pytest.raises(ConfigError) as err:
        from_dict(RootCfg, {"optim": {"lr": 0}})
    assert "lr must be > 0" in _one_line(err)


def test_yaml_file_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim: {lr: 1e-5\n")
    with pytest.raises(ConfigError) as err:
        load_yaml(RootCfg, bad)
    assert "not valid YAML" in _one_line(err)
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_yaml(RootCfg, bad)
    bad.write_text("staleness: {mod: bounded}\n")
    with pytest.raises(ConfigError) as err:
        load_yaml(RootCfg, bad)
    assert str(bad) in _one_line(err) and "did you mean 'mode'" in str(err.value)
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_yaml(RootCfg, tmp_path / "missing.yaml")
    bad.write_bytes(b"optim: {lr: \xff}\n")  # not UTF-8: one line naming the file, no traceback
    with pytest.raises(ConfigError) as err:
        load_yaml(RootCfg, bad)
    assert str(bad) in _one_line(err) and "not UTF-8" in str(err.value)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


@dataclass(frozen=True)
class TaskCfg:
    options: dict[str, ConfigValue] = field(default_factory=dict)
    """Free-form task options (plain data)."""
    limit: int | str = 1
    """A union that is not Optional."""


def test_plain_data_dict_fields_and_entry_overrides(tmp_path):
    cfg = from_dict(TaskCfg, {"options": {"hard": True, "levels": [1, {"depth": 2}]}})
    assert cfg.options == {"hard": True, "levels": [1, {"depth": 2}]}
    cfg = apply_overrides(cfg, ["options.hard=false", "options.sub.k=1e-3", "options.name=x"])
    assert cfg.options == {"hard": False, "levels": [1, {"depth": 2}], "sub": {"k": 0.001}, "name": "x"}
    assert load_yaml(TaskCfg, dump_yaml(cfg, tmp_path / "t.yaml")) == cfg
    with pytest.raises(ConfigError) as err:
        apply_overrides(cfg, ["options.hard.x=1"])
    assert "not a mapping" in _one_line(err)
    with pytest.raises(ConfigError) as err:
        apply_overrides(cfg, ["limit=[1]"])
    assert "does not fit int | str" in _one_line(err)


@dataclass(frozen=True)
class EnumCfg:
    stop: StopReason = StopReason.EOS
    """An enum field."""


def test_enum_fields():
    cfg = apply_overrides(EnumCfg(), ["stop=answer"])
    assert cfg.stop is StopReason.ANSWER and to_dict(cfg) == {"stop": "answer"}
    with pytest.raises(ConfigError) as err:
        apply_overrides(EnumCfg(), ["stop=done"])
    assert "valid choices: 'answer', 'eos'" in _one_line(err)


def test_non_finite_floats_are_refused_unless_the_field_allows_inf(tmp_path):
    """Issue 18, defect 6: optim.lr=inf trained NaN weights; nan is never a setting."""
    for text in ("optim.lr=inf", "optim.lr=-inf", "optim.lr=.nan", "window=.nan"):
        with pytest.raises(ConfigError) as err:
            apply_overrides(RootCfg(), [text])
        line = _one_line(err)
        assert text.split("=")[0] in line and ("finite" in line or "nan" in line), line
    assert apply_overrides(RootCfg(), ["window=inf"]).window == math.inf  # RootCfg.INFINITE_OK
    with pytest.raises(ConfigError, match=r"optim\.lr"):
        from_dict(RootCfg, {"optim": {"lr": float("inf")}})


def test_an_integer_too_large_for_a_float_is_one_line():
    """YAML reads 1 followed by 400 zeros as an int; a float field cannot hold it."""
    huge = "1" + "0" * 400
    for given in (lambda: apply_overrides(RootCfg(), [f"optim.lr={huge}"]),
                  lambda: from_dict(RootCfg, {"optim": {"lr": int(huge)}})):
        with pytest.raises(ConfigError) as err:
            given()
        line = _one_line(err)
        assert "optim.lr" in line and "too large" in line, line


def test_an_integer_beyond_64_bits_is_one_line_before_the_run_starts():
    """Every integer setting ends in torch or numpy (a seed in manual_seed, a count in a tensor shape)."""
    from copc.run.config import load_run_config

    for override in (f"seed={2**63}", f"seed={-(2**63) - 1}", f"rollout.group_size={10**30}",
                     f"model.tiny_seed={10**30}"):
        with pytest.raises(ConfigError) as err:
            load_run_config(None, [override])
        line = _one_line(err)
        assert override.split("=")[0] in line and "must fit in 64 bits" in line, line
    assert load_run_config(None, [f"seed={2**63 - 1}"]).seed == 2**63 - 1


def test_a_batch_no_step_can_hold_is_one_line_at_load():
    """group_size=10**18 fits 64 bits, but the rollout would build a list of 10**18 episodes and never
    return: the batch's size is bounded where the config is read."""
    from copc.run.config import load_run_config

    too_many = (["rollout.prompts_per_batch=2048", "rollout.group_size=1024"],
                [f"rollout.group_size={10**18}"])
    for overrides in too_many:
        with pytest.raises(ConfigError) as err:
            load_run_config(None, overrides)
        line = _one_line(err)
        assert "rollout.prompts_per_batch x rollout.group_size" in line and "lower" in line, line
    cfg = load_run_config(None, ["rollout.prompts_per_batch=1024", "rollout.group_size=1024"])
    assert cfg.rollout.batch_size == 2**20


def test_an_empty_yaml_file_is_an_error_not_the_defaults(tmp_path):
    for text in ("", "# only a comment\n"):
        path = tmp_path / "empty.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError, match="is empty"):
            load_yaml(RootCfg, path)


def test_a_yaml_file_reads_1e_5_as_a_number_and_refuses_a_duplicated_key(tmp_path):
    """YAML 1.1 reads ``1e-5`` as a string (the command line reads a number) and keeps the last of two
    equal keys; a config file must mean what it says."""
    path = tmp_path / "cfg.yaml"
    path.write_text("window: 1e-5\nweights:\n  a: -2E+3\n  b: 1.5e-2\n  c: 3\n")
    cfg = load_yaml(RootCfg, path)
    assert cfg.window == 1e-5 and cfg.weights == {"a": -2000.0, "b": 0.015, "c": 3.0}
    path.write_text("seed: 1\nweights:\n  a: 1.0\n  a: 2.0\n")
    with pytest.raises(ConfigError, match=r"cfg.yaml, line 4: key 'a' is given twice \(first on line 3\)"):
        load_yaml(RootCfg, path)
    path.write_text("seed: 1\nverbose: true\nseed: 2\n")
    with pytest.raises(ConfigError, match=r"line 3: key 'seed' is given twice"):
        load_yaml(RootCfg, path)
