"""ODBConfig validation: every bad value names the field, quotes the value and says the fix."""

from __future__ import annotations

import dataclasses
import math

import pytest

from odb.config import CONFIG_FIELDS, ODBConfig

_BAD = object()  # marks "the bad value is the one passed for the field"

# (field named in the message, keyword arguments, expected exception, value quoted in the message)
INVALID = [
    ("token_budget", {"token_budget": 0}, ValueError, _BAD),
    ("token_budget", {"token_budget": -16}, ValueError, _BAD),
    ("token_budget", {"token_budget": 16384.0}, TypeError, _BAD),
    ("token_budget", {"token_budget": "16384"}, TypeError, _BAD),
    ("token_budget", {"token_budget": True}, TypeError, _BAD),
    ("token_budget", {"token_budget": None}, TypeError, _BAD),
    ("token_budget", {"token_budget": ()}, ValueError, _BAD),
    ("token_budget", {"token_budget": (1024, 0)}, ValueError, 0),  # the offending entry
    ("token_budget", {"token_budget": (1024, 2.5)}, TypeError, 2.5),
    ("window_budgets", {"window_budgets": 0}, ValueError, _BAD),
    ("window_budgets", {"window_budgets": 1.5}, TypeError, _BAD),
    ("ready_batches", {"ready_batches": -1}, ValueError, _BAD),
    ("ready_batches", {"ready_batches": None}, TypeError, _BAD),
    ("buffer_size", {"buffer_size": 0}, ValueError, _BAD),
    ("buffer_size", {"buffer_size": -1}, ValueError, _BAD),
    ("buffer_size", {"buffer_size": 64.0}, TypeError, _BAD),
    ("buffer_size", {"buffer_size": None}, TypeError, _BAD),
    ("buffer_size", {"buffer_size": False}, TypeError, _BAD),
    ("first_window_size", {"first_window_size": 0}, ValueError, _BAD),
    ("budget_schedule", {"budget_schedule": ((1, 100),)}, ValueError, _BAD),
    ("probe_worst_case", {"probe_worst_case": 1}, TypeError, _BAD),
    ("distributed", {"distributed": "no"}, TypeError, _BAD),
    ("first_window_size", {"first_window_size": 2.0}, TypeError, _BAD),
    ("max_carry", {"max_carry": -1}, ValueError, _BAD),
    ("max_carry", {"max_carry": 1.5}, TypeError, _BAD),
    ("max_carry", {"max_carry": True}, TypeError, _BAD),
    ("pack_efficiency", {"pack_efficiency": 0.0}, ValueError, _BAD),
    ("pack_efficiency", {"pack_efficiency": -0.5}, ValueError, _BAD),
    ("pack_efficiency", {"pack_efficiency": 1.01}, ValueError, _BAD),
    ("pack_efficiency", {"pack_efficiency": math.inf}, ValueError, _BAD),
    ("pack_efficiency", {"pack_efficiency": math.nan}, ValueError, _BAD),
    ("pack_efficiency", {"pack_efficiency": "0.9"}, TypeError, _BAD),
    ("pack_efficiency", {"pack_efficiency": True}, TypeError, _BAD),
    ("pad_to_multiple_of", {"pad_to_multiple_of": 0}, ValueError, _BAD),
    ("pad_to_multiple_of", {"pad_to_multiple_of": 8.0}, TypeError, _BAD),
    ("pad_to_multiple_of", {"pad_to_multiple_of": None}, TypeError, _BAD),
    ("max_batch_size", {"max_batch_size": 0}, ValueError, _BAD),
    ("max_batch_size", {"max_batch_size": 2.5}, TypeError, _BAD),
    ("max_batch_size", {"max_batch_size": 4, "batch_size_multiple": 8}, ValueError, 4),
    ("batch_size_multiple", {"batch_size_multiple": 0}, ValueError, _BAD),
    ("batch_size_multiple", {"batch_size_multiple": 1.5}, TypeError, _BAD),
    ("batch_size_multiple", {"batch_size_multiple": None}, TypeError, _BAD),
    ("quadratic_length", {"quadratic_length": 0}, ValueError, _BAD),
    ("quadratic_length", {"quadratic_length": 4096.0}, TypeError, _BAD),
    ("length_fn", {"length_fn": 5}, TypeError, _BAD),
    ("length_fn", {"length_fn": "input_ids"}, TypeError, _BAD),
    ("loss_tokens_fn", {"loss_tokens_fn": "labels"}, TypeError, _BAD),
    ("max_image_patches", {"max_image_patches": 0, "image_patches_key": "pixel_values"}, ValueError, 0),
    ("max_image_patches", {"max_image_patches": 2.0, "image_patches_key": "pixel_values"}, TypeError, 2.0),
    ("max_image_patches", {"max_image_patches": 64}, ValueError, 64),  # key missing
    ("max_image_patches", {"image_patches_key": "pixel_values"}, ValueError, None),  # cap missing
    ("oversize", {"oversize": "drop"}, ValueError, _BAD),
    ("oversize", {"oversize": None}, ValueError, _BAD),
    ("seed", {"seed": -1}, ValueError, _BAD),
    ("seed", {"seed": 1.0}, TypeError, _BAD),
    ("seed", {"seed": True}, TypeError, _BAD),
    ("loss_scaling", {"loss_scaling": "mean"}, ValueError, _BAD),
    ("loss_scaling", {"loss_scaling": True}, ValueError, _BAD),
    ("gradient_accumulation_steps", {"gradient_accumulation_steps": 0}, ValueError, _BAD),
    ("global_batch_size", {"global_batch_size": 0}, ValueError, _BAD),
    ("global_batch_size", {"global_batch_size": 8.0}, TypeError, _BAD),
    ("micro_batch_cost", {"micro_batch_cost": -1.0}, ValueError, _BAD),
    ("micro_batch_cost", {"micro_batch_cost": "256"}, ValueError, _BAD),
    ("step_plan", {"step_plan": "ranks"}, ValueError, _BAD),
    ("composition", {"composition": "length-grouped"}, ValueError, _BAD),
    ("composition_block_steps", {"composition_block_steps": 0}, ValueError, _BAD),
    ("composition_block_steps", {"composition_block_steps": 4.0}, TypeError, _BAD),
    ("composition_warmup_steps", {"composition_warmup_steps": -1}, ValueError, _BAD),
    ("context_parallel", {"context_parallel": 0}, ValueError, _BAD),
    ("context_parallel_multiple", {"context_parallel_multiple": 0}, ValueError, _BAD),
    ("check_peers", {"check_peers": 1}, TypeError, _BAD),
    ("gradient_accumulation_steps", {"global_batch_size": 8, "gradient_accumulation_steps": 2}, ValueError, 2),
    ("gradient_accumulation_steps", {"gradient_accumulation_steps": 2.0}, TypeError, _BAD),
    ("exchange_timeout_s", {"exchange_timeout_s": 0}, ValueError, _BAD),
    ("exchange_timeout_s", {"exchange_timeout_s": -1.0}, ValueError, _BAD),
    ("exchange_timeout_s", {"exchange_timeout_s": math.nan}, ValueError, _BAD),
    ("exchange_timeout_s", {"exchange_timeout_s": "60"}, TypeError, _BAD),
    ("exchange_timeout_s", {"exchange_timeout_s": True}, TypeError, _BAD),
    ("transfer_chunk_size", {"transfer_chunk_size": 0}, ValueError, _BAD),
    ("transfer_chunk_size", {"transfer_chunk_size": 16.0}, TypeError, _BAD),
    ("join", {"join": 1}, TypeError, _BAD),
    ("join", {"join": "yes"}, TypeError, _BAD),
    ("shift_labels", {"shift_labels": 0}, TypeError, _BAD),
    ("ignore_index", {"ignore_index": -100.0}, TypeError, _BAD),
    ("ignore_index", {"ignore_index": False}, TypeError, _BAD),
    ("ignore_index", {"ignore_index": -(2**63)}, ValueError, _BAD),
    ("label_key", {"label_key": ""}, TypeError, _BAD),
    ("label_key", {"label_key": 3}, TypeError, _BAD),
    ("step_info_key", {"step_info_key": ""}, TypeError, _BAD),
    ("step_info_key", {"step_info_key": None}, TypeError, _BAD),
    ("layout", {"layout": "flat"}, ValueError, _BAD),
    ("layout", {"layout": None}, ValueError, _BAD),
    ("token_budget", {"token_budget": (1024, 1024), "layout": "packed"}, ValueError, _BAD),
    ("pad_to_multiple_of", {"pad_to_multiple_of": 8, "layout": "packed"}, ValueError, _BAD),
    ("batch_size_multiple", {"batch_size_multiple": 8, "layout": "packed"}, ValueError, _BAD),
    ("shape_buckets", {"shape_buckets": 1}, ValueError, _BAD),
    ("shape_buckets", {"shape_buckets": True}, TypeError, _BAD),
    ("shape_buckets", {"shape_buckets": 8.0}, TypeError, _BAD),
    ("shape_buckets", {"shape_buckets": ()}, ValueError, _BAD),
    ("shape_buckets", {"shape_buckets": (256, 128)}, ValueError, _BAD),
    ("shape_buckets", {"shape_buckets": (128, 128)}, ValueError, _BAD),
    ("shape_buckets", {"shape_buckets": (0, 128)}, ValueError, _BAD),
    ("shape_buckets", {"shape_buckets": (128, 256.0)}, TypeError, _BAD),
    ("shape_buckets", {"shape_buckets": (100, 256), "pad_to_multiple_of": 8}, ValueError, _BAD),
    ("shape_buckets", {"shape_buckets": (32768, 65536)}, ValueError, _BAD),  # no length within the budget
    ("shape_buckets", {"shape_buckets": 8, "layout": "packed"}, ValueError, _BAD),
    # token_budget="auto" and its options (docs/options.md)
    ("sample_cost", {"sample_cost": -1.0}, ValueError, _BAD),
    ("image_patch_cost", {"image_patch_cost": -1.0}, ValueError, _BAD),
    ("image_patch_cost", {"image_patch_cost": 0.5}, ValueError, _BAD),  # needs image_patches_key
    ("loss_token_cost", {"loss_token_cost": float("nan")}, ValueError, _BAD),
    ("balance", {"balance": "speed"}, ValueError, _BAD),
    ("balance", {"balance": "time"}, ValueError, _BAD),  # needs token_budget="auto"
    ("memory_cap_bytes", {"memory_cap_bytes": 0}, ValueError, _BAD),
    ("memory_fraction", {"memory_fraction": 1.5}, ValueError, _BAD),
    ("memory_meter", {"memory_meter": 3}, TypeError, _BAD),
    ("auto_start_budget", {"auto_start_budget": 0}, ValueError, _BAD),
    ("auto_margin", {"auto_margin": 0.0}, ValueError, _BAD),
]


@pytest.mark.parametrize("field, kwargs, exc, bad", INVALID,
                         ids=[f"{f}={kw.get(f, '<missing>')!r}" for f, kw, _, _ in INVALID])
def test_invalid_value_names_field_value_and_fix(field, kwargs, exc, bad) -> None:
    kwargs = dict(kwargs)
    kwargs.setdefault("token_budget", 16384)
    bad = kwargs[field] if bad is _BAD else bad
    with pytest.raises(exc) as info:
        ODBConfig(**kwargs)
    msg = str(info.value)
    assert type(info.value) is exc
    assert f"ODBConfig.{field}=" in msg
    assert repr(bad) in msg
    assert "Fix" in msg


def test_every_validated_field_has_a_bad_value_in_the_table() -> None:
    tested = {f for f, _, _, _ in INVALID}
    unvalidated = {"image_patches_key"}  # checked through max_image_patches (they come in pairs)
    assert CONFIG_FIELDS - tested == unvalidated


@pytest.mark.parametrize("kwargs", [
    {"token_budget": 1},
    {"token_budget": 16384},
    {"token_budget": (4096, 2048)},
    {"token_budget": (8,)},
    {"token_budget": 4096, "buffer_size": 1, "max_carry": 0},
    {"token_budget": 4096, "pack_efficiency": 1.0},
    {"token_budget": 4096, "pack_efficiency": 1},
    {"token_budget": 4096, "max_batch_size": 8, "batch_size_multiple": 8},
    {"token_budget": 4096, "quadratic_length": 4096, "pad_to_multiple_of": 64},
    {"token_budget": 4096, "image_patches_key": "n_patches", "max_image_patches": 1024},
    {"token_budget": 4096, "length_fn": len, "loss_tokens_fn": len},
    {"token_budget": 4096, "oversize": "alone", "seed": 0, "loss_scaling": "none"},
    {"token_budget": 4096, "oversize": "skip", "loss_scaling": "sample", "join": False, "shift_labels": True},
    {"token_budget": 4096, "exchange_timeout_s": 1, "ignore_index": 0, "gradient_accumulation_steps": 4},
    {"token_budget": 4096, "shape_buckets": (64, 256, 4096), "pad_to_multiple_of": 64},
])
def test_valid_configs_keep_their_values(kwargs) -> None:
    cfg = ODBConfig(**kwargs)
    for name, value in kwargs.items():
        assert getattr(cfg, name) == value


def test_defaults() -> None:
    cfg = ODBConfig(token_budget=16384)
    assert (cfg.window_budgets, cfg.buffer_size, cfg.max_carry, cfg.pad_to_multiple_of,
            cfg.batch_size_multiple) == (64, 32768, None, 1, 1)
    assert cfg.window_tokens == 64 * 16384 and cfg.ready_batches == 4
    assert ODBConfig(token_budget=(100, 50), window_budgets=2).window_tokens == 300
    assert ODBConfig(token_budget=100, window_budgets=None).window_tokens is None
    assert (cfg.oversize, cfg.loss_scaling, cfg.join, cfg.seed) == ("error", "exact", True, None)


def test_config_is_frozen() -> None:
    cfg = ODBConfig(token_budget=16384)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.buffer_size = 8  # type: ignore[misc]


def test_replace_copies_and_validates_again() -> None:
    cfg = ODBConfig(token_budget=16384, buffer_size=256)
    new = cfg.replace(buffer_size=512, pad_to_multiple_of=8)
    assert (new.buffer_size, new.pad_to_multiple_of, new.token_budget) == (512, 8, 16384)
    assert cfg.buffer_size == 256  # the original is untouched
    assert cfg.replace() == cfg
    with pytest.raises(ValueError, match=r"buffer_size=0.*Fix"):
        cfg.replace(buffer_size=0)
    with pytest.raises(TypeError):
        cfg.replace(no_such_option=1)


@pytest.mark.parametrize("budget, expected", [(16384, (16384,)), ((4096, 2048), (4096, 2048)), ((7,), (7,))])
def test_token_budgets(budget, expected) -> None:
    assert ODBConfig(token_budget=budget).token_budgets == expected


@pytest.mark.parametrize("window_samples, max_carry, expected", [
    (1024, None, 1024), (1, None, 1), (7, None, 7), (1024, 0, 0), (16, 100, 100), (1024, 33, 33)])
def test_carry_limit(window_samples, max_carry, expected) -> None:
    assert ODBConfig(token_budget=100, max_carry=max_carry).carry_limit(window_samples) == expected


@pytest.mark.parametrize("options, expected", [({}, 0.99), ({"layout": "packed"}, 0.95),
                                               ({"pack_efficiency": 0.9}, 0.9),
                                               ({"pack_efficiency": 0.9, "layout": "packed"}, 0.9)])
def test_emit_efficiency_defaults_per_layout(options, expected) -> None:
    assert ODBConfig(token_budget=100, **options).emit_efficiency == expected


def test_shape_buckets_int_becomes_the_halving_grid() -> None:
    assert ODBConfig(token_budget=16384, shape_buckets=8).shape_buckets == (128, 256, 512, 1024, 2048, 4096, 8192,
                                                                          16384)
    # rounded down to pad_to_multiple_of, from the largest scheduled budget
    assert ODBConfig(token_budget=1000, shape_buckets=3, pad_to_multiple_of=8).shape_buckets == (248, 496, 1000)
    scheduled = ODBConfig(token_budget=1024, shape_buckets=3, budget_schedule=((0, 1024), (10, 4096)))
    assert scheduled.shape_buckets == (1024, 2048, 4096)
    # a list becomes a tuple, and a later budget change keeps the grid (the shapes stay those of the run)
    cfg = ODBConfig(token_budget=1024, shape_buckets=[64, 128])
    assert cfg.shape_buckets == (64, 128) and cfg.replace(token_budget=4096).shape_buckets == (64, 128)
    assert cfg.emit_efficiency == 1.0 and cfg.replace(pack_efficiency=0.9).emit_efficiency == 0.9
