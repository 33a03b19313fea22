"""What every module of ``dpverify.hf`` shares: transformers, imported on first use, and the
configurations it loads.

transformers is an optional extra (``pip install 'dpverify[hf]'``): nothing here imports it
at module level, so ``import dpverify`` (and ``import dpverify.hf``) never loads it.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

from dpverify.core.errors import InvalidArgument

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["INSTALL", "load_config", "require_config", "require_transformers"]

INSTALL = "pip install 'dpverify[hf]'"


def require_transformers(what: str) -> ModuleType:
    """Imports transformers, or says what to install.

    Args:
        what: what needs it, for the message (``"shrink"``).

    Raises:
        InvalidArgument: transformers is not installed; the message names ``what`` and the
            install command.
    """
    try:
        import transformers
    except ImportError as error:
        raise InvalidArgument(f"{what} needs transformers, which is not installed: {INSTALL}") from error
    return transformers


def require_config(config: Any, what: str, argument: str = "config") -> PretrainedConfig:
    """``config`` when it is a Hugging Face configuration, else an ``InvalidArgument``.

    Args:
        config: the value to check.
        what: the function that takes it, for the message.
        argument: the argument's name, for the message.
    """
    transformers = require_transformers(what)
    if not isinstance(config, transformers.PretrainedConfig):
        raise InvalidArgument(
            f"{what}: {argument} must be a transformers PretrainedConfig (e.g. "
            f"dpverify.hf.load_config('llama')), got {type(config).__name__}"
        )
    return cast("PretrainedConfig", config)


def load_config(spec: str | Path) -> PretrainedConfig:
    """A Hugging Face configuration from a ``config.json`` file or a ``model_type`` name.

    Nothing is downloaded: a file is read as it is (its ``model_type`` picks the class), and
    a name such as ``"llama"`` gives that class's default configuration, from
    ``transformers.CONFIG_MAPPING``.

    Args:
        spec: the path of a ``config.json``, or a ``model_type`` name.

    Raises:
        InvalidArgument: ``spec`` is neither an existing file nor a known ``model_type``, or
            the file is not a configuration; the message names ``spec``.
    """
    transformers = require_transformers("load_config")
    path = Path(spec)
    if path.is_file():
        return _from_file(transformers, path)
    name = str(spec)
    if name in transformers.CONFIG_MAPPING:
        return transformers.CONFIG_MAPPING[name]()  # type: ignore[no-any-return]
    raise InvalidArgument(
        f"load_config: spec={name!r} is neither a config.json file nor a model_type of the "
        f"installed transformers {transformers.__version__} (e.g. 'llama', 'qwen2', 'mixtral'); "
        "pass the path of an existing config.json or one of transformers.CONFIG_MAPPING's names"
    )


def _from_file(transformers: ModuleType, path: Path) -> PretrainedConfig:
    """The configuration a ``config.json`` describes, of the class its ``model_type`` names."""
    try:
        fields = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InvalidArgument(f"load_config: spec={str(path)!r} is not a JSON file: {error}") from error
    model_type = fields.get("model_type") if isinstance(fields, dict) else None
    if model_type not in transformers.CONFIG_MAPPING:
        raise InvalidArgument(
            f"load_config: spec={str(path)!r} has model_type={model_type!r}, which the installed "
            f"transformers {transformers.__version__} does not know; a config.json names its "
            "architecture in model_type (e.g. \"llama\")"
        )
    return transformers.CONFIG_MAPPING[model_type].from_dict(fields)  # type: ignore[no-any-return]
