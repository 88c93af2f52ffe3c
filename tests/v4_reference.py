"""A float64 brute-force DeepSeek V4 forward written from the definitions,
independent of kvserve's model and cache code and of transformers' attention.

Per query t (one sequence from position 0): the last `sliding_window` K=V
keys including itself; the compressed entries whose windows end at or before
t (HCA: all of them; CSA: the Lightning Indexer's top-k of those, ties to
the earlier entry); and the per-head sink logit. Reads the weights of an HF
`DeepseekV4ForCausalLM` (its state dict and config).
"""
from __future__ import annotations

import math

import torch

F64 = torch.float64


def _rms(x, w=None, eps=1e-6):
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def _inv_freq(cfg, kind):
    p = cfg.rope_parameters[kind]
    dim, base = cfg.qk_rope_head_dim, p["rope_theta"]
    pos = base ** (torch.arange(0, dim, 2, dtype=F64) / dim)
    if p.get("rope_type", "default") != "yarn":
        return 1 / pos
    def corr(rot):
        return dim * math.log(p["original_max_position_embeddings"] / (rot * 2 * math.pi)) / (2 * math.log(base))
    lo, hi = max(math.floor(corr(p.get("beta_fast", 32))), 0), min(math.ceil(corr(p.get("beta_slow", 1))), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=F64) - lo) / (hi - lo if hi != lo else 0.001)).clamp(0, 1)
    return (1 / (p["factor"] * pos)) * ramp + (1 / pos) * (1 - ramp)


def _rope(x, pos, freq, sign=1.0):
    """Interleaved rotation of the trailing 2*len(freq) channels of x[..., D] at integer pos."""
    r = 2 * len(freq)
    a = pos * freq
    c, s = torch.cos(a), sign * torch.sin(a)
    y = x.clone()
    e, o = x[..., -r::2], x[..., -r + 1::2]
    y[..., -r::2], y[..., -r + 1::2] = e * c - o * s, o * c + e * s
    return y


class Reference:
    def __init__(self, hf_model):
        self.cfg = hf_model.config
        self.w = {k: v.detach().to(F64) if v.is_floating_point() else v for k, v in hf_model.state_dict().items()}
        self.freq = {k: _inv_freq(self.cfg, k) for k in ("main", "compress")}

    def logits(self, ids: list[int]) -> torch.Tensor:
        cfg, w = self.cfg, self.w
        x = w["model.embed_tokens.weight"][torch.tensor(ids)]
        streams = x[:, None, :].repeat(1, cfg.hc_mult, 1)
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            streams = self._hc(streams, p + "attn_hc", lambda h: self._attention(h, i, ids), p + "input_layernorm")
            streams = self._hc(streams, p + "ffn_hc", lambda h: self._moe(h, i, ids), p + "post_attention_layernorm")
        flat = _rms(streams.flatten(1), eps=cfg.rms_norm_eps) @ w["model.hc_head.hc_fn"].T
        pre = torch.sigmoid(flat * w["model.hc_head.hc_scale"] + w["model.hc_head.hc_base"]) + cfg.hc_eps
        h = _rms((pre[..., None] * streams).sum(1), w["model.norm.weight"], cfg.rms_norm_eps)
        return h @ w["lm_head.weight"].T

    def _hc(self, streams, p, block, norm):
        cfg, w, n = self.cfg, self.w, self.cfg.hc_mult
        mix = _rms(streams.flatten(1), eps=cfg.rms_norm_eps) @ w[p + ".fn"].T
        scale, base = w[p + ".scale"], w[p + ".base"]
        pre = torch.sigmoid(mix[:, :n] * scale[0] + base[:n]) + cfg.hc_eps
        post = 2 * torch.sigmoid(mix[:, n:2 * n] * scale[1] + base[n:2 * n])
        comb = torch.softmax(mix[:, 2 * n:].view(-1, n, n) * scale[2] + base[2 * n:].view(n, n), -1) + cfg.hc_eps
        comb = comb / (comb.sum(-2, keepdim=True) + cfg.hc_eps)
        for _ in range(cfg.hc_sinkhorn_iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + cfg.hc_eps)
            comb = comb / (comb.sum(-2, keepdim=True) + cfg.hc_eps)
        out = block(_rms((pre[..., None] * streams).sum(1), w[norm + ".weight"], cfg.rms_norm_eps))
        return post[..., None] * out[:, None, :] + comb.transpose(-1, -2) @ streams

    def _entries(self, h, p, rate, overlap, dim, freq):
        """Compressed entry per complete window: softmax(gate + ape)-pooled kv, normed, roped at w*rate."""
        w = self.w
        kv, gate = h @ w[p + "kv_proj.weight"].T, h @ w[p + "gate_proj.weight"].T
        out = []
        for win in range(len(h) // rate):
            rows = range(win * rate, (win + 1) * rate)
            vals = [kv[t, dim:] if overlap else kv[t] for t in rows]
            gates = [(gate[t] + w[p + "position_bias"][j])[dim:] if overlap else gate[t] + w[p + "position_bias"][j]
                     for j, t in enumerate(rows)]
            if overlap and win > 0:
                for j, t in enumerate(range((win - 1) * rate, win * rate)):
                    vals.append(kv[t, :dim])
                    gates.append((gate[t] + w[p + "position_bias"][j])[:dim])
            g = torch.softmax(torch.stack(gates), 0)
            e = _rms((g * torch.stack(vals)).sum(0), w[p + "kv_norm.weight"], self.cfg.rms_norm_eps)
            out.append(_rope(e, win * rate, freq))
        return torch.stack(out) if out else h.new_zeros((0, dim))

    def _attention(self, h, i, ids):
        cfg, w, p = self.cfg, self.w, f"model.layers.{i}.self_attn."
        kind, n_h, d = cfg.layer_types[i], cfg.num_attention_heads, cfg.head_dim
        freq = self.freq["main" if kind == "sliding_attention" else "compress"]
        pos = torch.arange(len(h), dtype=F64)[:, None]
        qr = _rms(h @ w[p + "q_a_proj.weight"].T, w[p + "q_a_norm.weight"], cfg.rms_norm_eps)
        q = _rope(_rms((qr @ w[p + "q_b_proj.weight"].T).view(len(h), n_h, d), eps=cfg.rms_norm_eps), pos[:, :, None], freq)
        kv = _rope(_rms(h @ w[p + "kv_proj.weight"].T, w[p + "kv_norm.weight"], cfg.rms_norm_eps), pos, freq)
        rate = cfg.compress_rates.get(kind, 0)
        entries = self._entries(h, p + "compressor.", rate, kind.startswith("compressed"), d, freq) if rate else None
        index_keys = (self._entries(h, p + "compressor.indexer.", rate, True, cfg.index_head_dim, freq)
                      if kind.startswith("compressed") else None)
        outs = []
        for t in range(len(h)):
            keys = [kv[s] for s in range(max(0, t - cfg.sliding_window + 1), t + 1)]
            if entries is not None:
                visible = [e for e in range(len(entries)) if (e + 1) * rate - 1 <= t]
                if kind.startswith("compressed"):
                    visible = self._top_k(h[t], qr[t], i, t, visible, index_keys)
                keys += [entries[e] for e in visible]
            k = torch.stack(keys)
            logits = torch.cat([(q[t] @ k.T) / math.sqrt(d), w[p + "sinks"][:, None]], 1)
            outs.append(torch.softmax(logits, -1)[:, :-1] @ k)
        o = _rope(torch.stack(outs), pos[:, :, None], freq, sign=-1.0).reshape(len(h), cfg.o_groups, -1)
        wa = w[p + "o_a_proj.weight"].view(cfg.o_groups, cfg.o_lora_rank, -1)
        return torch.einsum("tgi,goi->tgo", o, wa).flatten(1) @ w[p + "o_b_proj.weight"].T

    def _top_k(self, h, qr, i, t, visible, keys):
        """The indexer's index_topk best visible entries for the query at t (ties: earlier entry)."""
        cfg, w, p = self.cfg, self.w, f"model.layers.{i}.self_attn.compressor.indexer."
        q = _rope((qr @ w[p + "q_b_proj.weight"].T).view(cfg.index_n_heads, -1), float(t), self.freq["compress"])
        hw = (h @ w[p + "scorer.weights_proj.weight"].T) / math.sqrt(cfg.index_n_heads)
        score = {e: float((hw * torch.relu(q @ keys[e]) / math.sqrt(cfg.index_head_dim)).sum()) for e in visible}
        return sorted(visible, key=lambda e: (-score[e], e))[:cfg.index_topk]

    def _moe(self, h, i, ids):
        cfg, w, p = self.cfg, self.w, f"model.layers.{i}.mlp."
        lim = cfg.swiglu_limit
        def glu(x, gu, down):
            g, u = (x @ gu.T).chunk(2, -1)
            return (torch.nn.functional.silu(g.clamp(max=lim)) * u.clamp(-lim, lim)) @ down.T
        logits = h @ w[p + "gate.weight"].T
        scores = {"sqrtsoftplus": lambda z: torch.sqrt(torch.nn.functional.softplus(z)),
                  "sigmoid": torch.sigmoid}.get(cfg.scoring_func, lambda z: torch.softmax(z, -1))(logits)
        if cfg.mlp_layer_types[i] == "hash_moe":
            idx = w[p + "gate.tid2eid"][torch.tensor(ids)].long()
        else:
            idx = torch.topk(scores + w[p + "gate.e_score_correction_bias"], cfg.num_experts_per_tok, -1).indices
        wt = scores.gather(1, idx)
        wt = wt / wt.sum(-1, keepdim=True) * cfg.routed_scaling_factor
        out = torch.stack([sum(wt[t, j] * glu(h[t], w[p + "experts.gate_up_proj"][e], w[p + "experts.down_proj"][e])
                               for j, e in enumerate(idx[t].tolist())) for t in range(len(h))])
        sh = p + "shared_experts."
        g = h @ w[sh + "gate_proj.weight"].T
        u = h @ w[sh + "up_proj.weight"].T
        return out + (torch.nn.functional.silu(g.clamp(max=lim)) * u.clamp(-lim, lim)) @ w[sh + "down_proj.weight"].T

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        ids = list(prompt)
        for _ in range(n):
            ids.append(int(self.logits(ids)[-1].argmax()))
        return ids[len(prompt):]
