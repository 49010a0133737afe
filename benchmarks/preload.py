"""Imported once by the fork server so every benchmark child starts with torch and
transformers already loaded (children fork from it instead of re-importing)."""

import tokenizers  # noqa: F401
import torch  # noqa: F401
import transformers  # noqa: F401
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: F401
