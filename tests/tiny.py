"""Tiny models built in code: targets of every supported family, with a real tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 384
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "for i in range(10):\n    print(i * i)\n",
    "Speculative decoding drafts tokens and the target verifies them in one pass.",
    "import torch\nx = torch.zeros(3, 4)\nprint(x.shape)\n",
    "Hello, how are you today? I am fine, thank you very much.",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

FAMILIES = ("llama", "llama3", "mistral", "qwen2", "qwen3", "smollm")


# The geometry of the engine suite's tiny targets (tests/engines): vLLM's CPU attention takes head_dim
# 32 or more ("Unsupported CPU attention configuration: head_dim=16"). Family "llama-wide" is "llama" so.
WIDE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=64)


def tiny_config(family: str = "llama", vocab_size: int = VOCAB, **overrides):
    """A transformers config for a tiny model of `family` (random weights are made from it); a
    family ending in "-wide" takes the WIDE geometry."""
    if family.endswith("-wide"):
        return tiny_config(family[: -len("-wide")], vocab_size, **{**WIDE, **overrides})
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if family == "llama":
        cfg = LlamaConfig(**common, rope_theta=10000.0)
    elif family == "llama3":
        cfg = LlamaConfig(**common, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    elif family == "mistral":
        cfg = MistralConfig(**common, rope_theta=10000.0, sliding_window=None)
    elif family == "qwen2":
        cfg = Qwen2Config(**common, rope_theta=1000000.0)
    elif family == "qwen3":
        cfg = Qwen3Config(**common, head_dim=32, rope_theta=1000000.0)
    elif family in ("qwen3-moe", "qwen3-moe-plain"):  # layer 0 dense (mlp_only_layers), the rest 8 experts, top 2
        from transformers import Qwen3MoeConfig

        cfg = Qwen3MoeConfig(**common, head_dim=32, rope_theta=1000000.0, num_experts=8, num_experts_per_tok=2,
                             moe_intermediate_size=48, mlp_only_layers=[0], decoder_sparse_step=1,
                             norm_topk_prob=family == "qwen3-moe")
    elif family == "smollm":
        cfg = LlamaConfig(**{**common, "tie_word_embeddings": True}, rope_theta=10000.0)
    else:
        raise ValueError(f"unknown tiny family {family}")
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def make_tokenizer(out: Path, vocab_size: int = VOCAB):
    """Train a byte-level BPE on a small corpus and save it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def build_model(family: str = "llama", seed: int = 0, **overrides):
    """A transformers model of `family` with seeded random weights, fp32, eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), dtype=torch.float32)
    return model.eval()


def make_target(out: Path, family: str = "llama", seed: int = 0, shards: int = 1, **overrides) -> Path:
    """Write a tiny target as a Hugging Face model directory (config, tokenizer, safetensors)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(family, seed, **overrides)
    size_mb = sum(p.numel() * 4 for p in model.parameters()) / 1e6
    shard = f"{max(size_mb / shards * 1.05, 0.01):.3f}MB" if shards > 1 else "10GB"
    model.save_pretrained(out, safe_serialization=True, max_shard_size=shard)
    make_tokenizer(out, model.config.vocab_size)
    return out


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())
