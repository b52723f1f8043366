"""Hugging Face ``transformers`` models, built from a config (nothing is downloaded).

These factories return the library's own classes, unchanged: actorpipe splits them at
``split_points`` by tracing (see ``examples/train_hf.py``). Two settings make a model
trainable as a pipeline, and neither changes its maths: ``use_cache=False`` (a KV cache
is for generation; without it the model returns just its logits) and dropout 0 where
results are compared bit for bit (the examples keep the library's defaults otherwise).

Needs ``pip install 'actorpipe[hf]'``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["bert", "gemma", "gpt2", "gpt_neox", "llama", "mistral", "phi", "qwen2"]


def gpt2(layers: int = 4, dim: int = 64, heads: int = 4, vocab: int = 128, positions: int = 128,
         tie: bool = True, dropout: float = 0.0, **config: Any) -> nn.Module:
    """A ``GPT2LMHeadModel`` (token embeddings tied to the LM head unless ``tie=False``)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(
        n_layer=layers, n_embd=dim, n_head=heads, vocab_size=vocab, n_positions=positions,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, tie_word_embeddings=tie,
        bos_token_id=0, eos_token_id=0, use_cache=False, **config))


def llama(layers: int = 4, dim: int = 64, heads: int = 4, kv_heads: int = 2, vocab: int = 128,
          positions: int = 128, tie: bool = True, **config: Any) -> nn.Module:
    """A ``LlamaForCausalLM`` (rotary positions, grouped-query attention, SwiGLU; tied unless ``tie=False``)."""
    return _decoder("Llama", layers, dim, heads, vocab, positions, tie, num_key_value_heads=kv_heads, **config)


def qwen2(layers: int = 4, dim: int = 64, heads: int = 4, kv_heads: int = 2, vocab: int = 128,
          positions: int = 128, tie: bool = True, **config: Any) -> nn.Module:
    """A ``Qwen2ForCausalLM`` (LLaMA's shape with biased q/k/v projections; tied unless ``tie=False``)."""
    return _decoder("Qwen2", layers, dim, heads, vocab, positions, tie, num_key_value_heads=kv_heads, **config)


def _decoder(family: str, layers: int, dim: int, heads: int, vocab: int, positions: int, tie: bool,
             **config: Any) -> nn.Module:
    """A ``transformers`` causal LM of ``family`` (``Llama``, ``Qwen2``, ``Mistral``, ``Gemma``, ``Phi``, ``GPTNeoX``)
    from a small config: ``{family}Config`` and ``{family}ForCausalLM``."""
    import transformers

    config_cls = getattr(transformers, f"{family}Config")
    model_cls = getattr(transformers, f"{family}ForCausalLM")
    return model_cls(config_cls(
        num_hidden_layers=layers, hidden_size=dim, intermediate_size=2 * dim, num_attention_heads=heads,
        vocab_size=vocab, max_position_embeddings=positions, tie_word_embeddings=tie, bos_token_id=0,
        eos_token_id=0, pad_token_id=0, use_cache=False, **config))


def mistral(layers: int = 4, dim: int = 64, heads: int = 4, kv_heads: int = 2, vocab: int = 128,
            positions: int = 128, tie: bool = True, **config: Any) -> nn.Module:
    """A ``MistralForCausalLM`` (LLaMA's shape with sliding-window attention; tied unless ``tie=False``)."""
    return _decoder("Mistral", layers, dim, heads, vocab, positions, tie, num_key_value_heads=kv_heads, **config)


def gemma(layers: int = 4, dim: int = 64, heads: int = 4, kv_heads: int = 2, vocab: int = 128,
          positions: int = 128, tie: bool = True, **config: Any) -> nn.Module:
    """A ``GemmaForCausalLM`` (scaled embeddings, GeGLU, its own RMSNorm; tied unless ``tie=False``)."""
    return _decoder("Gemma", layers, dim, heads, vocab, positions, tie, num_key_value_heads=kv_heads,
                    head_dim=dim // heads, **config)


def phi(layers: int = 4, dim: int = 64, heads: int = 4, vocab: int = 128, positions: int = 128, tie: bool = True,
        **config: Any) -> nn.Module:
    """A ``PhiForCausalLM`` (parallel attention and MLP, partial rotary; tied unless ``tie=False``)."""
    return _decoder("Phi", layers, dim, heads, vocab, positions, tie, **config)


def gpt_neox(layers: int = 4, dim: int = 64, heads: int = 4, vocab: int = 128, positions: int = 128,
             tie: bool = False, **config: Any) -> nn.Module:
    """A ``GPTNeoXForCausalLM`` (Pythia's: fused QKV, parallel residual; untied, as GPT-NeoX is)."""
    return _decoder("GPTNeoX", layers, dim, heads, vocab, positions, tie, **config)


def bert(layers: int = 4, dim: int = 64, heads: int = 4, vocab: int = 128, positions: int = 128, tie: bool = True,
         dropout: float = 0.0, **config: Any) -> nn.Module:
    """A ``BertForMaskedLM``: a bidirectional encoder (absolute positions, post-norm, GELU) with its masked-LM
    head, which takes ``input_ids`` and an ``attention_mask`` over padding (tied unless ``tie=False``)."""
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(BertConfig(
        num_hidden_layers=layers, hidden_size=dim, intermediate_size=2 * dim, num_attention_heads=heads,
        vocab_size=vocab, max_position_embeddings=positions, tie_word_embeddings=tie, pad_token_id=0,
        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout, **config))
