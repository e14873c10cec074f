"""Hugging Face ``transformers`` models as they come (tiny configs, their defaults otherwise):
GPT-2 with its tied embeddings and KV cache on, BERT masked-LM (tied decoder weight and bias),
BERT sequence classification (non-persistent position ids) and Llama (SiLU MLP, whose backward
allocates with aten.empty_permuted). Losses against torch."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import ort_offload
from helpers import torch_losses
from ort_offload.export import optimizers

transformers = pytest.importorskip("transformers")

VOCAB = 100
ADAMW = optimizers.AdamW(lr=1e-3, weight_decay=0.01)
NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}  # random masks differ from torch's
BERT_NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


def gpt2():
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64,
                                     bos_token_id=0, eos_token_id=0, **NO_DROPOUT)
    return transformers.GPT2LMHeadModel(config)


def llama():
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
                                      intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64, use_cache=False,
                                      bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(config)


def bert_config(**options):
    return transformers.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                   vocab_size=VOCAB, max_position_embeddings=64, **BERT_NO_DROPOUT, **options)


def bert_mlm():
    return transformers.BertForMaskedLM(bert_config())


def bert_classifier():
    return transformers.BertForSequenceClassification(bert_config(num_labels=3))


def lm_loss(output, labels):
    """The model output is a ModelOutput: the loss function picks the logits."""
    logits = output.logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def class_loss(output, labels):
    return torch.nn.functional.cross_entropy(output.logits, labels)


def data(kind, steps=3, batch=2, seq=8):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
        labels = torch.randint(0, 3, (batch,), generator=g) if kind == "class" else torch.randint(0, VOCAB, (batch, seq), generator=g)
        out.append(((ids,), (labels,)))
    return out


MODELS = {
    "gpt2": (gpt2, lm_loss, "lm"),
    "bert-mlm": (bert_mlm, lm_loss, "lm"),
    "bert-cls": (bert_classifier, class_loss, "class"),
    "llama": (llama, lm_loss, "lm"),
}


def train(model, batches, loss_fn, name, budget):
    device = ort_offload.set_offload_device("cpu", budget=budget)
    trainer = ort_offload.create_ort_trainer(
        device, copy.deepcopy(model), loss_fn=loss_fn, example_inputs=batches[0][0],
        example_targets=batches[0][1], input_names=["ids"], target_names=["labels"], optimizer=ADAMW, name=name,
    )
    losses = [trainer.step(*inputs, *targets) for inputs, targets in batches]
    assert trainer.report()["within_budget"], trainer.report()
    return losses


# One model in the fast suite (BERT masked-LM: tied embeddings); the others run in test-all.
@pytest.mark.parametrize("name", [n if n == "bert-mlm" else pytest.param(n, marks=pytest.mark.slow) for n in sorted(MODELS)])
def test_trains_like_torch_unbudgeted_at_fractions_of_the_peak_and_at_the_stated_minimum(name):
    make, loss_fn, kind = MODELS[name]
    batches = data(kind)
    torch.manual_seed(0)
    model = make()
    expected = torch_losses(copy.deepcopy(model), batches, loss_fn, ADAMW)
    unplanned = train(model, batches, loss_fn, name, None)
    np.testing.assert_allclose(unplanned, expected, rtol=1e-5)
    with pytest.raises(ort_offload.BudgetTooSmallError) as refused:
        train(model, batches[:1], loss_fn, name, 1024)
    for budget in ("0.5x", "0.3x", refused.value.needed_bytes):
        assert train(model, batches, loss_fn, name, budget) == unplanned, budget  # planned runs: bitwise equal


@pytest.mark.slow  # a second bert export (~20 s); tied bert runs in the fast suite
def test_bert_masked_lm_with_untied_embeddings_trains_like_torch():
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(bert_config(tie_word_embeddings=False))
    batches = data("lm", steps=2)
    expected = torch_losses(copy.deepcopy(model), batches, lm_loss, ADAMW)
    device = ort_offload.set_offload_device("cpu")
    trainer = ort_offload.create_ort_trainer(
        device, copy.deepcopy(model), loss_fn=lm_loss, example_inputs=batches[0][0], example_targets=batches[0][1],
        input_names=["ids"], target_names=["labels"], optimizer=ADAMW, name="bert-mlm-untied",
    )
    assert "bert.embeddings.word_embeddings.weight" not in trainer.graph.tied_params.values()
    np.testing.assert_allclose([trainer.step(*i, *t) for i, t in batches], expected, rtol=1e-5)


@pytest.mark.parametrize("name", ["gpt2", pytest.param("llama", marks=pytest.mark.slow)])
def test_eval_gives_the_logits_of_the_trained_weights(name):
    """GPT-2's output holds a KV cache object (no graph output); Llama's parameters are named
    ``model.layers...``, which the eval graph must keep as the training state names them."""
    make, loss_fn, kind = MODELS[name]
    batches = data(kind, steps=1)
    torch.manual_seed(0)
    model = make()
    device = ort_offload.set_offload_device("cpu")
    trainer = ort_offload.create_ort_trainer(
        device, copy.deepcopy(model), loss_fn=loss_fn, example_inputs=batches[0][0], example_targets=batches[0][1],
        input_names=["ids"], target_names=["labels"], optimizer=ADAMW, name=name,
    )
    trainer.step(*batches[0][0], *batches[0][1])
    trained = trainer.copy_to(copy.deepcopy(model)).eval()
    with torch.no_grad():
        expected = trained(*batches[0][0]).logits.numpy()
    np.testing.assert_allclose(trainer.eval(*batches[0][0]), expected, rtol=1e-5, atol=1e-6)
