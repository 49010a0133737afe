"""The synthetic corpus: seeded, labelled by a rule on the prompt, intent revealed late."""

from __future__ import annotations

import random

from undercurrent.models import corpus
from undercurrent.models.corpus import (
    LABEL_NAMES,
    chat_prompt,
    first_revealing_index,
    generate_examples,
    make_example,
    revealing_words,
    vocabulary,
)


def _request_cues(prompt: str) -> tuple[bool, bool]:
    """(belongs to someone else, covert), read back from the prompt text."""
    other = any(f" {user} " in f" {prompt} " for user, _ in corpus._OTHER_OWNERS)
    covert = any(context in prompt for context in corpus._COVERT)
    return other, covert


def test_same_seed_same_corpus_and_other_seed_differs() -> None:
    assert generate_examples(50, seed=3) == generate_examples(50, seed=3)
    assert generate_examples(50, seed=3) != generate_examples(50, seed=4)


def test_label_is_someone_elses_thing_taken_covertly() -> None:
    for example in generate_examples(500, seed=11):
        other, covert = _request_cues(example.prompt)
        assert example.label == int(other and covert), example.prompt


def test_labels_are_balanced_and_every_cue_appears_under_both_labels() -> None:
    examples = generate_examples(2000, seed=5)
    harmful = sum(e.label for e in examples) / len(examples)
    assert 0.45 < harmful < 0.55
    benign_cues = {_request_cues(e.prompt) for e in examples if e.label == 0}
    # Neither cue alone decides: both occur in benign requests.
    assert {(True, False), (False, True), (False, False)} <= benign_cues


def test_prompt_never_contains_a_revealing_word() -> None:
    revealing = revealing_words()["benign"] | revealing_words()["harmful"]
    for example in generate_examples(300, seed=2):
        assert not set(example.prompt.split()) & revealing, example.prompt


def test_reply_reveals_its_own_label_after_a_shared_opening() -> None:
    for example in generate_examples(300, seed=9):
        words = example.reply.split()
        index = first_revealing_index(words, example.label)
        assert index is not None
        assert first_revealing_index(words, 1 - example.label) is None
        # The opening (acknowledgement, restatement, deliberation) comes first.
        assert index >= 8
        assert words[index - 5 : index] == ["the", "first", "step", "is", "to"]


def test_revealing_word_sets_are_disjoint_and_inside_the_vocabulary() -> None:
    words = revealing_words()
    assert words["benign"] and words["harmful"]
    assert not words["benign"] & words["harmful"]
    assert (words["benign"] | words["harmful"]) <= set(vocabulary())


def test_every_generated_word_is_in_the_vocabulary() -> None:
    vocab = set(vocabulary())
    for example in generate_examples(300, seed=1):
        assert set(example.text.split()) <= vocab


def test_make_example_honours_a_requested_label() -> None:
    rng = random.Random(0)
    assert {make_example(rng, label=1).label for _ in range(20)} == {1}
    assert make_example(rng, label=0).label_name == LABEL_NAMES[0]


def test_chat_prompt_matches_the_corpus_format() -> None:
    example = generate_examples(1, seed=0)[0]
    request = example.prompt.removeprefix("user : ").removesuffix(" assistant :")
    assert chat_prompt(request) == example.prompt
