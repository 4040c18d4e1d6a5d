"""A Policy as plain data: its dict form, reading that form back (schema, field names and
sub-tables; the values are the Policy's to check), and its TOML config text."""

from __future__ import annotations

import sys
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from ._policy_parts import SCHEMA, Fp8Options, LossScale, PolicyError, TunedOn
from ._registry import mode_names

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

if TYPE_CHECKING:
    from ._config import Policy


def policy_dict(policy: Policy) -> dict[str, Any]:
    """``schema`` and ``mode`` first; ``None`` fields omitted."""
    out: dict[str, Any] = {"schema": SCHEMA, "mode": policy.mode}
    for name in ("micro_batch_size", "grad_accum_steps", "grad_clip_norm", "reduce_dtype"):
        value = getattr(policy, name)
        if value is not None:
            out[name] = value
    if policy.loss_scale is not None:
        out["loss_scale"] = _table(policy.loss_scale)
    if policy.fp8 is not None:
        out["fp8"] = _table(policy.fp8)
    if policy.tuned_on is not None:
        tuned = _table(policy.tuned_on)
        tuned["libraries"] = {k: (v if v is not None else "") for k, v in policy.tuned_on.libraries}
        out["tuned_on"] = tuned
    return out


def policy_fields(data: Any, *, source: str, known: set[str]) -> dict[str, Any]:
    """A Policy's keyword arguments from a dict as :func:`policy_dict` writes it, the
    sub-tables built; a PolicyError names ``source``, the field and the allowed values."""
    if not isinstance(data, dict):
        raise PolicyError(f"{source}: expected a table of policy fields, got {type(data).__name__}")
    data = dict(data)
    schema = data.pop("schema", SCHEMA)
    if isinstance(schema, bool) or not isinstance(schema, int) or schema < 1:
        raise PolicyError(f"{source}: schema {schema!r} is not allowed; expected a positive integer")
    if schema > SCHEMA:
        raise PolicyError(
            f"{source}: schema {schema} is newer than this mpadvise understands ({SCHEMA}); "
            "upgrade mpadvise (pip install -U mpadvise)"
        )
    if "mode" not in data:
        raise PolicyError(f"{source}: missing 'mode'; expected one of {', '.join(mode_names())}")
    unknown = sorted(set(data) - known)
    if unknown:
        raise PolicyError(f"{source}: unknown field {unknown[0]!r}; expected one of schema, {', '.join(sorted(known))}")
    try:
        if "loss_scale" in data:
            data["loss_scale"] = _from_table(LossScale, data["loss_scale"], "loss_scale")
        if "fp8" in data:
            data["fp8"] = _from_table(Fp8Options, data["fp8"], "fp8")
        if "tuned_on" in data:
            tuned = dict(_require_table(data["tuned_on"], "tuned_on"))
            libs = tuned.get("libraries", {})
            if isinstance(libs, dict):
                tuned["libraries"] = tuple(sorted((str(k), v or None) for k, v in libs.items()))
            else:
                tuned["libraries"] = tuple(tuple(x) for x in libs)
            data["tuned_on"] = _from_table(TunedOn, tuned, "tuned_on")
    except (PolicyError, TypeError) as exc:
        raise PolicyError(f"{source}: {exc}") from None
    return data


def config_text(table: dict[str, Any], *, framework: str | None = None) -> str:
    """A header that says how to apply the policy, then its TOML."""
    import tomli_w

    if framework is None:
        how = "# mpadvise precision policy. Apply it in a training script with:\n#     mp = advisor.load_policy()\n"
    else:
        if not framework.replace("-", "").replace("_", "").isalnum():  # it goes into a comment line
            raise ValueError(f"framework {framework!r}: expected a name such as lightning")
        how = (f"# mpadvise precision policy for a {framework} script, which needs no changed line. Apply it by "
               "running the script with:\n#     mpadvise run SCRIPT -- ARGS\n")
    return how + "# Fields: see README.md, section 'The config file'\n" + tomli_w.dumps(table)


def parse_config_text(text: str, *, source: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(f"{source}: invalid TOML: {exc}") from None


def _table(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in fields(obj) if getattr(obj, f.name) is not None}


def _require_table(value: Any, name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise PolicyError(f"[{name}] must be a table, got {type(value).__name__} {value!r}")
    return value


def _from_table(cls: type, value: Any, name: str) -> Any:
    table = _require_table(value, name)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(table) - known)
    if unknown:
        raise PolicyError(f"[{name}] has unknown field {unknown[0]!r}; expected one of {', '.join(sorted(known))}")
    return cls(**table)
