"""The one error every tokenizer module raises (its own module, so each of them can import it without a cycle)."""


class TokenizerError(ValueError):
  """A tokenizer could not be loaded or used; the message names the file or model and the problem."""
