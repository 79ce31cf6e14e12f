"""Failures the engine confines to their requests still reach a person: each distinct one is logged, with its
traceback, on the `tinyvllm` logger (Python prints errors of an unconfigured logger to stderr).

A step that fails the same way again (every step on a broken GPU, say) is logged once, then counted at debug level:
one traceback says what broke, a thousand would bury it."""
from __future__ import annotations
import logging
from collections import OrderedDict

logger = logging.getLogger("tinyvllm")


class FailureLog:
  MAX_KEPT = 256   # distinct failures remembered; the oldest is forgotten (and would be logged again)

  def __init__(self):
    self.seen: OrderedDict[tuple[str, str, str], int] = OrderedDict()   # (where, type, message) -> times seen

  def record(self, where: str, error: BaseException, request_ids: list[str]) -> None:
    """`where` failed with `error`, failing the requests `request_ids`."""
    key = (where, type(error).__name__, str(error))
    ids = ", ".join(dict.fromkeys(request_ids)) or "no request"
    if key in self.seen:
      self.seen[key] += 1
      logger.debug("%s failed again (%d times) for %s: %s: %s", where, self.seen[key], ids, *key[1:])
      return
    self.seen[key] = 1
    if len(self.seen) > self.MAX_KEPT: self.seen.popitem(last=False)
    logger.error("%s failed for %s: %s: %s", where, ids, *key[1:], exc_info=error)
