"""Run names: deterministic, filesystem-safe, always carry the aggregation mode, and parse back exactly."""

import math
import random
import re
import struct

import pytest

from zcvae.runs.naming import (
    ABBREVIATIONS,
    AGGREGATION_MODE_FIELD,
    DEFAULT_EXCLUDE,
    MAX_NAME_LEN,
    parse_run_name,
    run_name,
)

AGG = AGGREGATION_MODE_FIELD
SAFE_NAME = re.compile(r"[A-Za-z0-9._-]+")
WRITABLE_STR = re.compile(r"[A-Za-z0-9.]+")

DEFAULTS = {
    AGG: "mean",
    "reconstruction_weight": 1.0,
    "distribution_normalized_reconstruction_weight": 0.0,
    "normalized_concentration_corrected_token_weighted_reconstruction_weight": 0.0,
    "token_weight_alpha": 1.0,
    "kl_weight": 1.0,
    "num_latents": 4,
    "latent_type": "discrete",
    "seed": 0,
    "backbone": "models/tiny",
    "output_dir": "runs",
    "gradient_checkpointing": False,
    "max_grad_norm": None,
}


def test_example_format_and_order():
    params = dict(DEFAULTS, **{AGG: "sum", "distribution_normalized_reconstruction_weight": 1.0,
                               "kl_weight": 3.0, "seed": 2})
    assert run_name(params, DEFAULTS) == "agg-sum_dist-1_beta-3_seed-2"


def test_aggregation_mode_always_present_so_mean_and_sum_never_collide():
    mean = run_name(DEFAULTS, DEFAULTS)
    total = run_name(dict(DEFAULTS, **{AGG: "sum"}), DEFAULTS)
    assert mean == "agg-mean"
    assert total == "agg-sum"
    assert parse_run_name(mean, DEFAULTS)[AGG] == "mean"
    assert parse_run_name(total, DEFAULTS)[AGG] == "sum"


def test_values_are_lossless_and_typed_by_defaults():
    params = dict(DEFAULTS, kl_weight=0.1 + 0.2, token_weight_alpha=-1e-300, num_latents=-7,
                  reconstruction_weight=1e20, gradient_checkpointing=True, max_grad_norm=0.5,
                  distribution_normalized_reconstruction_weight=-0.5)
    name = run_name(params, DEFAULTS)
    assert "+" not in name and "beta-0.30000000000000004" in name
    back = parse_run_name(name, DEFAULTS)
    assert back == params
    assert type(back["num_latents"]) is int and type(back["kl_weight"]) is float
    assert back["gradient_checkpointing"] is True
    negative_zero = parse_run_name(run_name(dict(DEFAULTS, kl_weight=-0.0), DEFAULTS), DEFAULTS)["kl_weight"]
    assert negative_zero == 0.0 and math.copysign(1.0, negative_zero) == -1.0


def test_non_finite_floats_round_trip():
    for value in (math.inf, -math.inf):
        assert parse_run_name(run_name(dict(DEFAULTS, kl_weight=value), DEFAULTS), DEFAULTS)["kl_weight"] == value
    assert math.isnan(parse_run_name(run_name(dict(DEFAULTS, kl_weight=math.nan), DEFAULTS), DEFAULTS)["kl_weight"])


def test_paths_are_hashed_not_written_and_still_distinguish_runs():
    a = run_name(dict(DEFAULTS, backbone="/models/a-1"), DEFAULTS)
    b = run_name(dict(DEFAULTS, backbone="/models/b_2"), DEFAULTS)
    assert a != b and "/" not in a and re.search(r"_hash-[0-9a-f]{10}$", a)
    assert parse_run_name(a, DEFAULTS)["backbone"] == DEFAULTS["backbone"]  # documented: not recoverable


def test_text_that_would_read_back_as_a_number_is_hashed():
    for text in ("123", "inf", "true", "None"):
        name = run_name(dict(DEFAULTS, max_grad_norm=text), DEFAULTS)  # None default: no type to go by
        assert re.fullmatch(r"agg-mean_hash-[0-9a-f]{10}", name)
        assert parse_run_name(name, DEFAULTS)["max_grad_norm"] is None


def test_train_config_fields_do_not_clash_with_abbreviations():
    config = pytest.importorskip("zcvae.config")
    defaults = config.TrainConfig().to_dict() if hasattr(config.TrainConfig, "to_dict") else None
    if defaults is None:
        import dataclasses
        defaults = dataclasses.asdict(config.TrainConfig())
    assert run_name(defaults, defaults) == "agg-mean"
    abbreviations = {abbrev: field for field, abbrev in ABBREVIATIONS.items()}
    for field in defaults:
        assert abbreviations.get(field, field) == field, f"{field} is another field's abbreviation"
    params = dict(defaults, **{AGG: "sum", "kl_weight": 3.0, "seed": 2, "num_latents": 8})
    assert parse_run_name(run_name(params, defaults), defaults) == params


def test_excluded_fields_do_not_change_the_name():
    assert run_name(dict(DEFAULTS, output_dir="/elsewhere"), DEFAULTS) == run_name(DEFAULTS, DEFAULTS)
    assert "output_dir" in DEFAULT_EXCLUDE


def test_lossy_values_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="num_latents"):
        run_name(dict(DEFAULTS, num_latents=2.5), DEFAULTS)
    with pytest.raises(ValueError, match="gradient_checkpointing"):
        run_name(dict(DEFAULTS, gradient_checkpointing=1), DEFAULTS)


def test_field_named_like_another_fields_abbreviation_is_refused():
    with pytest.raises(ValueError, match="beta"):
        run_name(dict(DEFAULTS, beta=2.0), DEFAULTS)


def test_always_field_missing_everywhere_is_an_error():
    with pytest.raises(ValueError, match=AGG):
        run_name({"seed": 1}, {"seed": 0})


def test_long_names_are_truncated_with_a_stable_hash_and_refuse_to_parse():
    defaults = dict(DEFAULTS, **{f"extra_long_field_name_number_{i}": 0.0 for i in range(12)})
    params = dict(defaults, **{f"extra_long_field_name_number_{i}": 0.25 + i for i in range(12)})
    name = run_name(params, defaults)
    assert len(name) <= MAX_NAME_LEN and SAFE_NAME.fullmatch(name)
    assert re.search(r"__[0-9a-f]{16}$", name)
    reordered = dict(reversed(list(params.items())))
    assert run_name(reordered, defaults) == name
    other = dict(params, extra_long_field_name_number_11=99.0)  # differs only past the cut
    assert run_name(other, defaults) != name
    assert run_name(other, defaults)[:100] == name[:100]
    with pytest.raises(ValueError, match="truncated"):
        parse_run_name(name, defaults)


def test_malformed_names_are_rejected():
    for bad in ("", "agg", "agg-sum_", "-x", "a b-1", "agg-sum_beta-x"):
        with pytest.raises(ValueError):
            parse_run_name(bad, DEFAULTS)


# ---- property-style round trip over many random parameter dicts -------------------------------------

_POOL = list(ABBREVIATIONS) + ["lora_rank", "warmup_steps", "x", "use_x2", "weight_decay", "task_file"]


def _random_float(rng):
    if rng.random() < 0.5:
        return rng.choice([0.0, 1.0, 0.5, 3.0, 1e-5, 2.5e-4, -0.25, 1e16, 123456.789])
    while True:
        value = struct.unpack("<d", rng.getrandbits(64).to_bytes(8, "little"))[0]
        if not math.isnan(value):
            return value


def _random_str(rng, *, writable_prefix=""):
    alphabet = "abcXYZ019."
    text = writable_prefix + "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6)))
    if rng.random() < 0.25:
        text = rng.choice(["/data/", "a_b", "with space", "x-y", ""]) + text
    return text


def _random_value(rng, kind):
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "int":
        return rng.choice([rng.randint(-5, 5), rng.getrandbits(70) - 2**69])
    if kind == "float":
        return float(rng.randint(-3, 3)) if rng.random() < 0.1 else _random_float(rng)
    if kind == "str":
        return _random_str(rng)
    if kind == "list":
        return [rng.randint(0, 3)]
    # kind "none": a field whose default is None takes floats, ints, bools, None or letter-led strings
    return rng.choice([None, rng.random() < 0.5, rng.randint(-9, 9), _random_float(rng),
                       _random_str(rng, writable_prefix="s")])


_MISSING = object()


def _looks_typed(text):
    """Text a typeless (None) default would read back as something other than this string."""
    if text in ("None", "true", "false"):
        return True
    try:
        float(text)
        return True
    except ValueError:
        return False


def _expected(params, defaults):
    """What the name must carry: written here independently of the implementation's own split."""
    out = dict(defaults)
    for field, value in params.items():
        if field in DEFAULT_EXCLUDE:
            continue
        writable = value is None or isinstance(value, (bool, int, float)) or (
            isinstance(value, str) and WRITABLE_STR.fullmatch(value)
            and (isinstance(defaults.get(field), str) or not _looks_typed(value)))
        if writable:
            out[field] = value
    return out


@pytest.mark.parametrize("seed", range(4))
def test_round_trip_over_random_parameter_dicts(seed):
    rng = random.Random(seed)
    for _ in range(150):
        fields = rng.sample(_POOL, rng.randint(1, 6))
        defaults, params = {AGG: "mean"}, {AGG: rng.choice(["mean", "sum"])}
        for field in fields:
            if field == AGG:
                continue
            kind = rng.choice(["bool", "int", "float", "str", "none", "list"])
            defaults[field] = None if kind == "none" else _random_value(rng, kind)
            if rng.random() < 0.7:
                params[field] = _random_value(rng, kind)
        if rng.random() < 0.3:
            params["output_dir"] = _random_str(rng)
        name = run_name(params, defaults)
        assert SAFE_NAME.fullmatch(name) and len(name) <= MAX_NAME_LEN
        assert f"agg-{params[AGG]}" in name
        assert run_name(dict(reversed(list(params.items()))), defaults) == name  # order-independent
        if len(name) == MAX_NAME_LEN and "__" in name:
            with pytest.raises(ValueError):
                parse_run_name(name, defaults)
            continue
        expected = _expected(params, defaults)
        assert parse_run_name(name, defaults) == expected, name
        # changing any one carried value changes the name
        carried = [f for f in params if f not in DEFAULT_EXCLUDE and expected.get(f, _MISSING) is params[f]]
        field = rng.choice(carried)
        changed = dict(params, **{field: "zz9" if isinstance(params[field], str) else
                                  (not params[field]) if isinstance(params[field], bool) else
                                  (params[field] or 0) + 1})
        if changed[field] != params[field]:
            assert run_name(changed, defaults) != name, (field, params[field], changed[field])
