"""Writes a tiny Llama model as a GGUF file (the layout llama.cpp's converter produces), for tests.

The file holds a byte-level BPE tokenizer (the three ChatML special tokens, the 256 byte symbols
and a few merges), a ChatML chat template, and the weights of a random 2-layer Llama: every tensor
in float32 except the token embedding, which is Q8_0 (so loading really dequantizes). The returned
reference model has exactly the weights the file encodes (the embedding is the dequantized Q8_0
one), so a correct loader reproduces its logits.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MERGES = ("h e", "l l", "he ll", "Ġ w", "o r")
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _byte_symbols() -> list[str]:
    # GPT-2's byte-to-unicode table: printable bytes stand for themselves, the rest are shifted
    # past 255 so that every byte has a visible symbol.
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    shifted, symbols = 0, {}
    for b in range(256):
        if b in keep:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + shifted)
            shifted += 1
    return [symbols[b] for b in range(256)]


def _permute_rope(w: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp stores q/k rows interleaved per head (rotary pairs adjacent); loaders undo this.
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: str | Path, *, seed: int = 0, hidden: int = 64, layers: int = 2, heads: int = 4,
                    kv_heads: int = 2, ffn: int = 128):
    """Write the tiny model to ``path``; returns ``(reference LlamaForCausalLM, vocab list)``."""
    import gguf
    import transformers

    tokens = list(SPECIALS) + _byte_symbols() + [m.replace(" ", "") for m in MERGES]
    vocab = len(tokens)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=kv_heads, max_position_embeddings=256,
                                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
                                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    emb = model.model.embed_tokens.weight.detach().numpy().astype(np.float32)
    q8 = gguf.quants.quantize(emb, gguf.GGMLQuantizationType.Q8_0)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.from_numpy(
            gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0).reshape(emb.shape).copy()))
        for p in model.model.norm.parameters():
            p.uniform_(0.5, 1.5)  # non-trivial norms, so a dropped norm weight shows in the logits

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-test-llama")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(hidden // heads)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (vocab - len(SPECIALS)))
    w.add_token_merges(list(MERGES))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    names = {"self_attn.o_proj": "attn_output", "self_attn.v_proj": "attn_v", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(layers):
        pre = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_q.weight", _permute_rope(sd[pre + "self_attn.q_proj.weight"], heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", _permute_rope(sd[pre + "self_attn.k_proj.weight"], kv_heads))
        for hf, gg in names.items():
            w.add_tensor(f"blk.{i}.{gg}.weight", sd[pre + hf + ".weight"])
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[pre + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[pre + "post_attention_layernorm.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model, tokens
