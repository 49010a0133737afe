"""Fit, evaluate and ship the bundled model's linear probe, through undercurrent itself.

``python -m tools.tiny_model.probe_fit`` runs the loop a researcher would:

1. **capture**: generate greedily for fresh corpus prompts with a spec that
   captures ``residual_stream`` at every layer for every generated token
   (``ProbedModel`` with ``records=True``);
2. **label**: each request takes its prompt's intent (benign / harmful) from the
   corpus generator, and each generated token is marked as before or after the
   first word that makes the intent visible in the text;
3. **fit**: ``fit_linear_probe`` per layer on the training prompts; score every
   layer on held-out prompts (not in the model's training corpus), and the same
   on a random-init model of the same shape as a control;
4. **ship**: the best layer's probe goes to ``tiny/probe.safetensors``, with an
   abort threshold chosen on the training prompts, and every number to
   ``tiny/probe_report.json`` (``docs/model.md`` quotes it).
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tools.tiny_model.train import TRAIN_SEED, TrainingConfig
from undercurrent.analysis.fitting import fit_linear_probe, save_linear_probe
from undercurrent.api import ProbedModel
from undercurrent.models import tiny_model_path
from undercurrent.models.corpus import (
    Example,
    first_revealing_index,
    generate_examples,
    make_example,
)
from undercurrent.probes.weights import apply_link

PROBE_FIT_SEED = 7_000
"""Seeds the probe's training prompts; held-out prompts use ``PROBE_FIT_SEED + 1``."""
MAX_NEW_TOKENS = 60
THRESHOLD_GRID = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.97, 0.99)


def capture_spec(layers: Sequence[int]) -> dict[str, Any]:
    """A spec capturing ``residual_stream`` at ``layers`` for every generated token."""
    return {
        "version": "1",
        "extraction_points": [{
            "name": "residual",
            "layers": list(layers),
            "tensor_type": "residual_stream",
            "position": "generated[*]",
            "probe_type": "norm_probe",
            "probe_kind": "single_shot",
            "execution_mode": "inline",
        }],
    }


def probe_prompts(count: int, seed: int, exclude: set[str] | None = None) -> list[Example]:
    """``count`` corpus examples (balanced labels) whose prompts are not in ``exclude``."""
    rng = random.Random(seed)
    examples: list[Example] = []
    seen = set(exclude or ())
    while len(examples) < count:
        example = make_example(rng, label=len(examples) % 2)
        if example.prompt not in seen:
            seen.add(example.prompt)
            examples.append(example)
    return examples


@dataclass
class Captured:
    """Activations of one set of generations, one matrix per layer.

    Row ``i`` of every layer's matrix is the same generated token: request
    ``request[i]`` (index into ``examples``), generated index ``generated[i]``.
    ``reveal[r]`` is the generated index where request ``r``'s text first shows its
    intent (None if it never does); ``texts[r]`` its generated words.
    """

    examples: list[Example]
    layers: dict[int, Any]
    request: Any
    generated: Any
    reveal: list[int | None]
    texts: list[list[str]]

    @property
    def labels(self) -> Any:
        """Per-row label (0 benign, 1 harmful)."""
        import numpy as np

        return np.array([self.examples[r].label for r in self.request])

    def before_reveal(self) -> Any:
        """Boolean mask of rows whose token comes before the intent shows in the text."""
        import numpy as np

        limit = np.array([r if r is not None else 10**9 for r in self.reveal])
        return self.generated < limit[self.request]


def capture(model: Any, tokenizer: Any, examples: Sequence[Example],
            layers: Sequence[int], batch_size: int = 50) -> Captured:
    """Generate greedily for ``examples`` through ``ProbedModel`` and collect activations.

    ``model`` is a loaded transformers model (or a path), ``tokenizer`` its tokenizer.
    """
    import numpy as np


    if isinstance(model, (str, Path)):
        probed = ProbedModel.from_pretrained(str(model), spec=capture_spec(layers))
    else:
        probed = ProbedModel(model, tokenizer, spec=capture_spec(layers))
    try:
        outputs = probed.generate([e.prompt for e in examples], max_new_tokens=MAX_NEW_TOKENS,
                                  records=True, batch_size=batch_size)
    finally:
        probed.close()
    rows: dict[int, list[Any]] = {layer: [] for layer in layers}
    request_of: list[int] = []
    generated_of: list[int] = []
    reveal: list[int | None] = []
    texts: list[list[str]] = []
    for index, (example, output) in enumerate(zip(examples, outputs, strict=True)):
        words = [str(w) for w in tokenizer.convert_ids_to_tokens(list(output.token_ids))]
        texts.append(words)
        reveal.append(first_revealing_index(words, example.label))
        by_token: dict[int, dict[int, Any]] = {}
        for record in output.records or ():
            by_token.setdefault(record.generated_index, {})[record.layer] = record.tensor
        for generated_index in sorted(by_token):
            tensors = by_token[generated_index]
            if len(tensors) != len(layers):
                continue
            for layer in layers:
                rows[layer].append(tensors[layer].float().numpy())
            request_of.append(index)
            generated_of.append(generated_index)
    return Captured(
        examples=list(examples),
        layers={layer: np.stack(rows[layer]) for layer in layers},
        request=np.array(request_of),
        generated=np.array(generated_of),
        reveal=reveal,
        texts=texts,
    )


def probe_scores(weight: Any, bias: Any, matrix: Any) -> Any:
    """``sigmoid(matrix @ weight + bias)``: P(harmful) per row."""
    import numpy as np

    logits = np.asarray(matrix, dtype=np.float64) @ np.asarray(weight, np.float64) + float(bias)
    return apply_link("sigmoid", logits)


def first_crossings(captured: Captured, scores: Any, threshold: float) -> list[int | None]:
    """Per request, the first generated index whose score is >= ``threshold``."""
    first: list[int | None] = [None] * len(captured.examples)
    order = sorted(range(len(scores)), key=lambda i: (captured.request[i], captured.generated[i]))
    for row in order:
        request = int(captured.request[row])
        if first[request] is None and scores[row] >= threshold:
            first[request] = int(captured.generated[row])
    return first


def accuracy_summary(captured: Captured, scores: Any) -> dict[str, float]:
    """Token-level accuracy at 0.5: all generated tokens, and those before the reveal."""
    import numpy as np

    correct = (scores >= 0.5) == (captured.labels == 1)
    early = captured.before_reveal()
    first = captured.generated == 0
    return {
        "accuracy_all_tokens": float(correct.mean()),
        "accuracy_before_reveal": float(correct[early].mean()),
        "accuracy_first_token": float(correct[first].mean()),
        "auc_before_reveal": _auc(scores[early], captured.labels[early]),
        "tokens": int(len(correct)),
        "tokens_before_reveal": int(np.count_nonzero(early)),
    }


def _auc(scores: Any, labels: Any) -> float:
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(labels, scores))


def abort_summary(captured: Captured, scores: Any, threshold: float) -> dict[str, Any]:
    """What an abort at ``threshold`` does to each held-out generation."""
    import numpy as np

    first = first_crossings(captured, scores, threshold)
    harmful = [i for i, e in enumerate(captured.examples) if e.label == 1]
    benign = [i for i, e in enumerate(captured.examples) if e.label == 0]
    leads = [captured.reveal[i] - first[i] for i in harmful
             if first[i] is not None and captured.reveal[i] is not None]
    before = [i for i in harmful if first[i] is not None
              and (captured.reveal[i] is None or first[i] < captured.reveal[i])]
    crossing = [first[i] for i in harmful if first[i] is not None]
    reveals = [captured.reveal[i] for i in harmful if captured.reveal[i] is not None]
    return {
        "threshold": threshold,
        "harmful_aborted": len(crossing) / max(1, len(harmful)),
        "harmful_aborted_before_reveal": len(before) / max(1, len(harmful)),
        "benign_aborted": sum(first[i] is not None for i in benign) / max(1, len(benign)),
        "median_crossing_token": float(np.median(crossing)) if crossing else None,
        "median_reveal_token": float(np.median(reveals)) if reveals else None,
        "median_lead_tokens": float(np.median(leads)) if leads else None,
        "min_lead_tokens": int(min(leads)) if leads else None,
    }


def choose_threshold(captured: Captured, scores: Any, max_false_aborts: float = 0.01) -> float:
    """The lowest grid threshold aborting at most ``max_false_aborts`` of benign requests."""
    for threshold in THRESHOLD_GRID:
        if abort_summary(captured, scores, threshold)["benign_aborted"] <= max_false_aborts:
            return threshold
    return THRESHOLD_GRID[-1]


def bag_of_words_accuracy(train: Sequence[Example], heldout: Sequence[Example]) -> float:
    """Held-out accuracy of logistic regression on the prompts' word counts.

    The reference for "can the intent be read off the words alone": the corpus
    is built so that it cannot, much (see :mod:`undercurrent.models.corpus`).
    """
    from sklearn.feature_extraction.text import CountVectorizer
    from sklearn.linear_model import LogisticRegression

    vectorizer = CountVectorizer(token_pattern=r"\S+")
    features = vectorizer.fit_transform([e.prompt for e in train])
    model = LogisticRegression(max_iter=5000).fit(features, [e.label for e in train])
    return float(model.score(vectorizer.transform([e.prompt for e in heldout]),
                             [e.label for e in heldout]))


def random_init_model(reference: Any, seed: int = 0) -> Any:
    """A freshly initialised model with ``reference``'s config (the control)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(reference.config).eval()


def fit_and_report(model_dir: Path, train_count: int = 300, heldout_count: int = 200,
                   out_probe: Path | None = None) -> dict[str, Any]:
    """Run capture -> label -> fit -> evaluate for the trained and the random-init model.

    Writes the best layer's probe to ``out_probe`` when given; returns the report.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer


    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    trained = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    layers = list(range(trained.config.num_hidden_layers))
    corpus_prompts = {e.prompt for e in generate_examples(TrainingConfig.examples, TRAIN_SEED)}
    train_examples = probe_prompts(train_count, PROBE_FIT_SEED, exclude=corpus_prompts)
    heldout_examples = probe_prompts(heldout_count, PROBE_FIT_SEED + 1,
                                     exclude=corpus_prompts | {e.prompt for e in train_examples})
    report: dict[str, Any] = {
        "train_requests": train_count, "heldout_requests": heldout_count,
        "layers": {}, "max_new_tokens": MAX_NEW_TOKENS,
        "bag_of_words_accuracy": bag_of_words_accuracy(train_examples, heldout_examples),
    }
    fits: dict[int, Any] = {}
    for name, model in (("trained", trained), ("random_init", random_init_model(trained))):
        train_capture = capture(model, tokenizer, train_examples, layers)
        heldout_capture = capture(model, tokenizer, heldout_examples, layers)
        for layer in layers:
            fit = fit_linear_probe(train_capture.layers[layer], train_capture.labels,
                                   layer=layer, tensor_type="residual_stream", test_size=0.0,
                                   group_by=None, C=0.1, seed=0)
            scores = probe_scores(fit.weight, fit.bias, heldout_capture.layers[layer])
            entry = report["layers"].setdefault(str(layer), {})
            entry[name] = accuracy_summary(heldout_capture, scores)
            if name == "trained":
                train_scores = probe_scores(fit.weight, fit.bias, train_capture.layers[layer])
                threshold = choose_threshold(train_capture, train_scores)
                entry[name]["abort"] = abort_summary(heldout_capture, scores, threshold)
                fits[layer] = (fit, threshold)
        if name == "trained":
            report["example_generations"] = [
                {"label": e.label_name, "prompt": e.prompt, "reply": " ".join(words),
                 "reveal_token": reveal}
                for e, words, reveal in list(zip(heldout_examples, heldout_capture.texts,
                                                 heldout_capture.reveal, strict=True))[:4]
            ]
            report["heldout_revealed"] = sum(
                r is not None for r in heldout_capture.reveal) / heldout_count
    best = max(layers, key=lambda layer: (
        report["layers"][str(layer)]["trained"]["accuracy_before_reveal"],
        report["layers"][str(layer)]["trained"]["accuracy_all_tokens"]))
    fit, threshold = fits[best]
    report["best_layer"] = best
    report["threshold"] = threshold
    if out_probe is not None:
        import dataclasses


        shipped = dataclasses.replace(fit, threshold=threshold, label_names=("benign", "harmful"))
        save_linear_probe(shipped, out_probe)
    return report


def report_markdown(report: dict[str, Any]) -> str:
    """The report's numbers as the Markdown tables ``docs/model.md`` quotes."""

    def pct(value: float | None) -> str:
        return "-" if value is None else f"{100 * value:.1f}%"

    lines = [
        "| layer | trained, all generated tokens | trained, before the words show it "
        "| random-init, all tokens | random-init, before the words "
        "| AUC before the words: trained / random-init |",
        "|---|---|---|---|---|---|",
    ]
    for layer, entry in sorted(report["layers"].items(), key=lambda item: int(item[0])):
        trained, control = entry["trained"], entry["random_init"]
        best = " (shipped)" if int(layer) == report["best_layer"] else ""
        lines.append(
            f"| {layer}{best} | {pct(trained['accuracy_all_tokens'])} "
            f"| {pct(trained['accuracy_before_reveal'])} | {pct(control['accuracy_all_tokens'])} "
            f"| {pct(control['accuracy_before_reveal'])} "
            f"| {trained['auc_before_reveal']:.3f} / {control['auc_before_reveal']:.3f} |"
        )
    abort = report["layers"][str(report["best_layer"])]["trained"]["abort"]
    lines += [
        "",
        "| threshold | harmful aborted | harmful aborted before the words | benign aborted "
        "| median crossing token | median reveal token | median lead (tokens) |",
        "|---|---|---|---|---|---|---|",
        f"| {abort['threshold']:g} | {pct(abort['harmful_aborted'])} "
        f"| {pct(abort['harmful_aborted_before_reveal'])} | {pct(abort['benign_aborted'])} "
        f"| {abort['median_crossing_token']} | {abort['median_reveal_token']} "
        f"| {abort['median_lead_tokens']} |",
        "",
        f"Logistic regression on the prompts' word counts (no model at all): "
        f"{pct(report['bag_of_words_accuracy'])} held-out.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; see the module docstring."""

    parser = argparse.ArgumentParser(prog="python -m tools.tiny_model.probe_fit",
                                     description="Fit and ship the bundled model's probe.")
    parser.add_argument("--model", type=Path, default=tiny_model_path())
    parser.add_argument("--train", type=int, default=300, help="training prompts")
    parser.add_argument("--heldout", type=int, default=200, help="held-out prompts")
    parser.add_argument("--dry-run", action="store_true", help="report only; ship nothing")
    args = parser.parse_args(argv)
    out_probe = None if args.dry_run else args.model / "probe.safetensors"
    report = fit_and_report(args.model, args.train, args.heldout, out_probe)
    text = json.dumps(report, indent=2) + "\n"
    if not args.dry_run:
        (args.model / "probe_report.json").write_text(text)
    print(text)
    print(report_markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
