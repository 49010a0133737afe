"""Train, evaluate and ship the bundled model's sparse autoencoder (SAELens format).

``python -m tools.tiny_model.sae_fit`` (a few seconds to a minute of CPU):

1. **capture** layer 3's ``residual_stream`` for every generated token of fresh
   corpus prompts, through ``ProbedModel`` (as :mod:`tools.tiny_model.probe_fit`
   does), on training prompts and on the probe's held-out prompts;
2. **train** a TopK SAE (``k`` active features of ``d_sae``) with a short,
   seeded torch loop: Adam on the reconstruction error, decoder rows kept at unit
   norm, ``W_enc`` initialised to ``W_dec.T`` and ``b_dec`` to the data mean.
   SAELens's own trainer needs a TransformerLens model and a dataset runner; this
   writes the same on-disk format;
3. **evaluate** on held-out tokens: explained variance, L0, dead features, and,
   for every feature, its ROC AUC against the request's label (benign 0 /
   harmful 1). The feature chosen as "the harmful-intent feature" is picked on the
   training tokens and reported on the held-out ones, to keep the choice honest;
4. **ship** ``tiny/sae/cfg.json`` + ``tiny/sae/sae_weights.safetensors`` and every
   number in ``tiny/sae/report.json`` (``docs/sae.md`` quotes it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

LAYER = 3
D_SAE = 512
K = 16
STEPS = 3000
BATCH = 512
LEARNING_RATE = 1e-3
SAE_FIT_SEED = 11_000
"""Seeds the SAE's training prompts (held-out ones are the probe's held-out prompts)."""


def sae_config(d_in: int, d_sae: int = D_SAE, k: int = K) -> dict[str, Any]:
    """``cfg.json`` for a TopK SAE on layer 3's residual stream, as SAELens 6 writes it."""
    return {
        "d_in": d_in, "d_sae": d_sae, "dtype": "float32", "device": "cpu",
        "apply_b_dec_to_input": True, "normalize_activations": "none",
        "reshape_activations": "none",
        "metadata": {
            "sae_lens_version": "6.54.12", "sae_lens_training_version": "6.54.12",
            "model_name": "undercurrent/tiny", "hook_name": f"blocks.{LAYER}.hook_resid_post",
            "trained_by": "tools.tiny_model.sae_fit",
        },
        "k": k, "rescale_acts_by_decoder_norm": False, "architecture": "topk",
    }


def train_topk_sae(data: Any, *, d_sae: int = D_SAE, k: int = K, steps: int = STEPS,
                   batch: int = BATCH, lr: float = LEARNING_RATE, seed: int = 0) -> dict[str, Any]:
    """Fit a TopK SAE to ``data`` (rows, d_in) float32; returns float32 numpy arrays
    ``W_enc``, ``b_enc``, ``W_dec``, ``b_dec``. Deterministic for a seed."""
    import numpy as np
    import torch

    torch.manual_seed(seed)
    x = torch.tensor(data, dtype=torch.float32)
    d_in = x.shape[1]
    w_dec = torch.randn(d_sae, d_in)
    w_dec = w_dec / w_dec.norm(dim=1, keepdim=True)
    params = {
        "W_dec": torch.nn.Parameter(w_dec),
        "W_enc": torch.nn.Parameter(w_dec.T.clone()),
        "b_enc": torch.nn.Parameter(torch.zeros(d_sae)),
        "b_dec": torch.nn.Parameter(x.mean(dim=0)),
    }
    optimiser = torch.optim.Adam(params.values(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    scale = x.var(dim=0).sum()
    for _ in range(steps):
        rows = x[torch.randint(0, x.shape[0], (batch,), generator=generator)]
        acts = _topk_encode(rows, params, k)
        recon = acts @ params["W_dec"] + params["b_dec"]
        loss = ((recon - rows) ** 2).sum(dim=1).mean() / scale
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        with torch.no_grad():
            params["W_dec"] /= params["W_dec"].norm(dim=1, keepdim=True)
    return {name: np.ascontiguousarray(p.detach().numpy(), dtype=np.float32)
            for name, p in params.items()}


def _topk_encode(rows: Any, params: dict[str, Any], k: int) -> Any:
    import torch

    pre = (rows - params["b_dec"]) @ params["W_enc"] + params["b_enc"]
    values, indices = torch.topk(pre, k, dim=1)
    return torch.zeros_like(pre).scatter(1, indices, values.relu())


def evaluate(sae: Any, captured: Any, chosen: int | None = None,
             threshold: float | None = None) -> dict[str, Any]:
    """Explained variance, L0, dead features and label AUCs on a capture's layer-3 rows.

    AUCs are ROC AUCs against the request's label (harmful = 1), per feature:
    ``request`` scores each request by the feature's peak over its generated
    tokens (the ``max`` that ``sae_probe``'s verdict reports), ``token`` scores
    each token by the feature's activation; ``before_reveal`` keeps only the
    tokens generated before the reply's words make the intent visible. The
    ``harmful`` feature is the one with the best before-reveal request AUC
    (``chosen`` when given, so a choice made on training data is scored here).
    ``threshold`` (default: the feature's highest peak on a benign request here)
    gives the share of harmful and benign requests whose peak crosses it, and the
    median number of tokens between the first crossing and the reveal.
    """
    import numpy as np

    data = captured.layers[LAYER].astype("float64")
    acts = sae.encode(data)
    recon = acts @ sae.W_dec + sae.b_dec
    residual = ((data - recon) ** 2).sum()
    total = ((data - data.mean(axis=0)) ** 2).sum()
    alive = np.flatnonzero((acts > 0).any(axis=0))
    early = captured.before_reveal()
    aucs = {
        "request_auc": _request_aucs(acts, captured, alive, np.ones(len(acts), dtype=bool)),
        "request_auc_before_reveal": _request_aucs(acts, captured, alive, early),
        "token_auc": _token_aucs(acts, captured.labels, alive),
        "token_auc_before_reveal": _token_aucs(acts[early], captured.labels[early], alive),
    }
    feature = int(np.argmax(aucs["request_auc_before_reveal"])) if chosen is None else chosen
    fires = acts[:, feature] > 0
    labels = captured.labels
    result: dict[str, Any] = {
        "tokens": int(data.shape[0]),
        "tokens_before_reveal": int(early.sum()),
        "explained_variance": float(1.0 - residual / total),
        "l0": float((acts > 0).sum(axis=1).mean()),
        "dead_features": int(sae.d_sae - alive.size),
        "harmful_feature": feature,
        "harmful_feature_fires_on_harmful_tokens": float(fires[labels == 1].mean()),
        "harmful_feature_fires_on_benign_tokens": float(fires[labels == 0].mean()),
    }
    for name, values in aucs.items():
        result[f"harmful_feature_{name}"] = float(values[feature])
        result[f"best_{name}_any_feature"] = float(values.max())
    result["features_with_request_auc_above_0.9"] = int((aucs["request_auc"] > 0.9).sum())
    result.update(_crossings(acts[:, feature], captured, threshold))
    return result


def _crossings(column: Any, captured: Any, threshold: float | None) -> dict[str, Any]:
    """How a threshold on one feature splits the requests, and how early it crosses."""
    import numpy as np

    labels = np.array([example.label for example in captured.examples])
    peaks = np.zeros(len(labels))
    np.maximum.at(peaks, captured.request, column)
    if threshold is None:
        threshold = float(peaks[labels == 0].max())
    leads = []
    for request in np.flatnonzero(labels == 1):
        rows = np.flatnonzero((captured.request == request) & (column > threshold))
        reveal = captured.reveal[request]
        if rows.size and reveal is not None:
            leads.append(reveal - int(captured.generated[rows].min()))
    return {
        "threshold": threshold,
        "harmful_requests_crossing": float((peaks[labels == 1] > threshold).mean()),
        "benign_requests_crossing": float((peaks[labels == 0] > threshold).mean()),
        "median_lead_tokens_before_reveal": float(np.median(leads)) if leads else None,
    }


def _request_aucs(acts: Any, captured: Any, alive: Any, rows: Any) -> Any:
    """Per-feature AUC of each request's peak activation over the selected rows."""
    import numpy as np

    peaks = np.zeros((len(captured.examples), acts.shape[1]))
    np.maximum.at(peaks, captured.request[rows], acts[rows])
    seen = np.zeros(len(captured.examples), dtype=bool)
    seen[captured.request[rows]] = True
    labels = np.array([example.label for example in captured.examples])
    return _token_aucs(peaks[seen], labels[seen], alive)


def _token_aucs(acts: Any, labels: Any, alive: Any) -> Any:
    import numpy as np
    from sklearn.metrics import roc_auc_score

    aucs = np.full(acts.shape[1], 0.5)
    for feature in alive:
        aucs[feature] = roc_auc_score(labels, acts[:, feature])
    return aucs


def fit_and_report(model_dir: Path, out_dir: Path | None, train_count: int = 600,
                   heldout_count: int = 200, steps: int = STEPS) -> dict[str, Any]:
    """Capture, train, evaluate; writes the SAE folder to ``out_dir`` when given."""
    import torch
    from safetensors.numpy import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tools.tiny_model.probe_fit import PROBE_FIT_SEED, capture, probe_prompts
    from tools.tiny_model.train import TRAIN_SEED, TrainingConfig
    from undercurrent.models.corpus import generate_examples
    from undercurrent.probes.sae_files import load_sae

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    corpus_prompts = {e.prompt for e in generate_examples(TrainingConfig.examples, TRAIN_SEED)}
    heldout = probe_prompts(heldout_count, PROBE_FIT_SEED + 1, exclude=corpus_prompts)
    train = probe_prompts(train_count, SAE_FIT_SEED,
                          exclude=corpus_prompts | {e.prompt for e in heldout})
    train_capture = capture(model, tokenizer, train, [LAYER])
    heldout_capture = capture(model, tokenizer, heldout, [LAYER])
    train_data = train_capture.layers[LAYER]
    weights = train_topk_sae(train_data, steps=steps)
    target = out_dir if out_dir is not None else Path(_scratch_dir())
    target.mkdir(parents=True, exist_ok=True)
    config = sae_config(int(train_data.shape[1]))
    (target / "cfg.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(weights, str(target / "sae_weights.safetensors"))
    sae = load_sae(target)
    on_train = evaluate(sae, train_capture)
    chosen = on_train["harmful_feature"]
    report = {
        "layer": LAYER, "tensor_type": "residual_stream", "architecture": "topk",
        "d_in": int(train_data.shape[1]), "d_sae": D_SAE, "k": K, "steps": steps,
        "batch": BATCH, "learning_rate": LEARNING_RATE,
        "train_requests": train_count, "heldout_requests": heldout_count,
        "harmful_feature": chosen,
        "train": on_train,
        "heldout": evaluate(sae, heldout_capture, chosen=chosen,
                            threshold=on_train["threshold"]),
    }
    if out_dir is not None:
        (out_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _scratch_dir() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="undercurrent-sae-")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; see the module docstring."""
    from undercurrent.models import tiny_model_path

    parser = argparse.ArgumentParser(prog="python -m tools.tiny_model.sae_fit",
                                     description="Train and ship the bundled model's SAE.")
    parser.add_argument("--model", type=Path, default=tiny_model_path())
    parser.add_argument("--train", type=int, default=600, help="training prompts")
    parser.add_argument("--heldout", type=int, default=200, help="held-out prompts")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--dry-run", action="store_true", help="report only; ship nothing")
    args = parser.parse_args(argv)
    out_dir = None if args.dry_run else args.model / "sae"
    report = fit_and_report(args.model, out_dir, args.train, args.heldout, args.steps)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
