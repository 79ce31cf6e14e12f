"""Engine flags for every command line, built from `EngineConfig`'s fields (their help, type and choices live
there), so `generate`, `serve` and `bench` never retype them."""
from __future__ import annotations
import argparse
from dataclasses import MISSING, fields
from tinyvllm.config import EngineConfig


def add_engine_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup, exclude: tuple[str, ...] = ()) -> None:
  """One `--field-name` flag per EngineConfig field (but `model`, which each command places itself)."""
  for f in fields(EngineConfig):
    if f.name == "model" or f.name in exclude: continue
    meta, flag = f.metadata, "--" + f.name.replace("_", "-")
    text = meta["help"].replace("%", "%%")   # argparse formats help with %
    if meta["type"] is bool: parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=text)
    else: parser.add_argument(flag, type=meta["type"], default=f.default, choices=meta["choices"], help=text)


def engine_kwargs(args: argparse.Namespace, exclude: tuple[str, ...] = ()) -> dict:
  """The engine arguments a parsed command line gives, for `LLM(model, **kwargs)`: only flags that differ from the
  default, so an unset flag never overrides what a caller passes beside them."""
  defaults = {f.name: f.default for f in fields(EngineConfig) if f.default is not MISSING}
  return {name: getattr(args, name) for name in defaults
          if name != "model" and name not in exclude and hasattr(args, name) and getattr(args, name) != defaults[name]}
