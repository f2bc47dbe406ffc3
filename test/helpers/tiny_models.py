"""Small random-init Hugging Face decoders the serving, generation and regional-import tests share (no downloads;
the callers import transformers, or skip, before calling)."""

from __future__ import annotations


def tiny_llama(layers: int, kv_heads: int = 2):
    """A LLaMA of 64 wide, 4 heads over `kv_heads` K/V heads, 100 tokens; seed 0, eval mode."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=kv_heads, vocab_size=100)
    return transformers.LlamaForCausalLM(cfg).eval()


def tiny_gpt2(layers: int):
    """A GPT-2 of 64 wide, 4 heads, 128 positions, 100 tokens; seed 0, eval mode."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=64, n_layer=layers, n_head=4, n_positions=128, vocab_size=100,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).eval()
