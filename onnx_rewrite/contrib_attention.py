"""onnxruntime's attention contrib ops in float64, for the float64 copy (DESIGN §4): onnxruntime has
float32/float16 kernels only (onnxruntime-genai's model builder writes GroupQueryAttention).

Written from the ops' contract in onnxruntime's CPU kernels (contrib_ops/cpu/bert), checked against
them by tests/test_llm_files.py. Cases this code does not follow (right-padded prompts, position_ids
or attention_bias inputs, head sinks, smooth softmax) raise NotImplementedError, so the float64 run
says it could not run them rather than computing something else.
"""
from __future__ import annotations

import numpy as np


def rotate(x: np.ndarray, pos: np.ndarray, cos_cache: np.ndarray, sin_cache: np.ndarray,
           interleaved: bool) -> np.ndarray:
    """Rotary embedding of x [B, N, S, H] at positions pos [B, S]: its first 2·cos_cache.shape[1]
    features turned by the angles of the caches' rows (the rest unchanged), as halves (rotate_half)
    or as interleaved pairs."""
    half = cos_cache.shape[1]
    cos = cos_cache.astype(np.float64)[pos][:, None]  # [B, 1, S, half]
    sin = sin_cache.astype(np.float64)[pos][:, None]
    out = x.astype(np.float64).copy()
    first, second = (slice(0, 2 * half, 2), slice(1, 2 * half, 2)) if interleaved else \
        (slice(0, half), slice(half, 2 * half))
    a, b = x[..., first], x[..., second]
    out[..., first], out[..., second] = a * cos - b * sin, b * cos + a * sin
    return out


def _heads(x: np.ndarray, n: int) -> np.ndarray:
    """[B, S, n·H] -> [B, n, S, H]."""
    b, s, width = x.shape
    return x.reshape(b, s, n, width // n).transpose(0, 2, 1, 3)


def group_query_attention(query, key, value, past_key, past_value, seqlens_k, total_sequence_length,
                          cos_cache, sin_cache, *, num_heads: int, kv_num_heads: int, scale: float = 0.0,
                          softcap: float = 0.0, do_rotary: int = 0, rotary_interleaved: int = 0,
                          local_window_size: int = -1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """com.microsoft GroupQueryAttention: (output [B, S, N·H], present_key, present_value [B, N_kv,
    T_present, H]). Q, K, V from `query` alone when key/value are absent (packed [B, S, (N + 2·N_kv)·H]);
    each sequence b holds seqlens_k[b] + 1 tokens in all, its past the first total - S of them (none in a
    first prompt, S == total_sequence_length); causal, with an optional local window and softcap."""
    dtype = query.dtype
    batch, seq = query.shape[:2]
    if key is None:  # packed QKV
        head = query.shape[2] // (num_heads + 2 * kv_num_heads)
        q_w, kv_w = num_heads * head, kv_num_heads * head
        query, key, value = query[..., :q_w], query[..., q_w:q_w + kv_w], query[..., q_w + kv_w:]
    q, k, v = (_heads(t.astype(np.float64), n) for t, n in ((query, num_heads), (key, kv_num_heads),
                                                            (value, kv_num_heads)))
    head = q.shape[-1]
    total = int(np.asarray(total_sequence_length).reshape(-1)[0])
    lengths = np.asarray(seqlens_k).reshape(-1).astype(np.int64) + 1  # tokens of each sequence
    first_prompt = seq == total
    if first_prompt and np.any(lengths != seq):
        raise NotImplementedError("GroupQueryAttention: a padded first prompt (seqlens_k + 1 != sequence length)")
    past_lens = np.zeros(batch, np.int64) if first_prompt else lengths - seq
    buffer = past_key.shape[2] if past_key is not None else 0
    if np.any(past_lens < 0) or np.any(past_lens > buffer):
        raise NotImplementedError("GroupQueryAttention: seqlens_k disagrees with the past and the sequence")
    pos = past_lens[:, None] + np.arange(seq)[None, :]
    if do_rotary:
        q, k = (rotate(t, pos, cos_cache, sin_cache, bool(rotary_interleaved)) for t in (q, k))
    present_len = max(total, buffer)
    present_k = np.zeros((batch, kv_num_heads, present_len, head))
    present_v = np.zeros_like(present_k)
    for b, p in enumerate(past_lens):
        if p:
            present_k[b, :, :p], present_v[b, :, :p] = past_key[b, :, :p], past_value[b, :, :p]
        present_k[b, :, p:p + seq], present_v[b, :, p:p + seq] = k[b], v[b]
    alpha = scale if scale else 1 / np.sqrt(head)
    group = num_heads // kv_num_heads
    keys, values = np.repeat(present_k, group, axis=1), np.repeat(present_v, group, axis=1)
    scores = alpha * q @ keys.transpose(0, 1, 3, 2)  # [B, N, S, T_present]
    if softcap > 0:
        scores = softcap * np.tanh(scores / softcap)
    j = np.arange(present_len)[None, None, :]
    causal = past_lens[:, None, None] + np.arange(seq)[None, :, None] + 1  # [B, S, 1]: keys each row sees
    visible = j < causal
    if local_window_size > 0:
        visible &= j >= causal - local_window_size
    scores = np.where(visible[:, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    out = (probs @ values).transpose(0, 2, 1, 3).reshape(batch, seq, num_heads * head)
    return out.astype(dtype), present_k.astype(dtype), present_v.astype(dtype)


def ops() -> list:
    """The ops above as onnx reference-evaluator ops (sessions.contrib_ops adds them)."""
    from onnx.reference.op_run import OpRun

    class GroupQueryAttention(OpRun):
        op_domain = "com.microsoft"

        def _run(self, query, key=None, value=None, past_key=None, past_value=None, seqlens_k=None,
                 total_sequence_length=None, cos_cache=None, sin_cache=None, position_ids=None,
                 attention_bias=None, head_sink=None, num_heads=None, kv_num_heads=None, scale=0.0, softcap=0.0,
                 do_rotary=0, rotary_interleaved=0, local_window_size=-1, smooth_softmax=0, qk_output=0, **_):
            if position_ids is not None or attention_bias is not None or head_sink is not None or smooth_softmax \
                    or qk_output:
                raise NotImplementedError("GroupQueryAttention with position_ids, attention_bias, head_sink, "
                                          "smooth_softmax or qk_output")
            return group_query_attention(query, key, value, past_key, past_value, seqlens_k, total_sequence_length,
                                         cos_cache, sin_cache, num_heads=num_heads, kv_num_heads=kv_num_heads,
                                         scale=scale or 0.0, softcap=softcap or 0.0, do_rotary=do_rotary or 0,
                                         rotary_interleaved=rotary_interleaved or 0,
                                         local_window_size=-1 if local_window_size is None else local_window_size)

    return [GroupQueryAttention]
