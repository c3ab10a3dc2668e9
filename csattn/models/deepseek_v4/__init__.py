"""DeepSeek-V4 decoder (HF ``DeepseekV4ForCausalLM`` layout) for training on packed sequences."""

from .checkpoint import LoadReport, experts_filter, load_pretrained, save_pretrained
from .config import DeepseekV4ModelConfig
from .model import IGNORE_INDEX, CausalLMOutput, DeepseekV4ForCausalLM, future_tokens

__all__ = ["DeepseekV4ModelConfig", "DeepseekV4ForCausalLM", "CausalLMOutput", "IGNORE_INDEX", "future_tokens",
           "load_pretrained", "save_pretrained", "LoadReport", "experts_filter"]
