"""Hugging Face's Trainer itself against onnxtrain: the same GPT-2 start, micro-batches and rates, trained by
transformers.Trainer (gradient accumulation over padded micro-batches, AdamW with its decay groups, clipping, a
linear warmup) and by from_torch's model with the options the README names for it; to_torch brings the result back
to compare parameter by parameter. tests/test_optimizers.py pins each rule against plain torch loops."""

from __future__ import annotations

import copy

import numpy as np
import pytest

import onnxtrain

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("onnxscript")  # from_torch's exporter
pytest.importorskip("accelerate")  # the Trainer's own requirement (the test extra installs it)

from zoo_models import Logits, perturbed  # noqa: E402  (imports torch)

VOCAB, PAD, BATCH, K, UPDATES = 32, 0, 2, 3, 3


def padded_lm_batches() -> tuple[list[dict[str, list[int]]], "transformers.DataCollatorForLanguageModeling"]:
    """Sequences of 3 to 8 tokens, and the collator a causal LM is trained with: right-padded to 8 (one export
    shape), labels the ids with -100 on the padding, so each micro-batch counts different labels."""
    from tokenizers import Tokenizer, models

    vocab = {"<pad>": PAD, **{f"t{i}": i for i in range(1, VOCAB)}}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")), pad_token="<pad>",
        model_input_names=["input_ids", "attention_mask"])
    rng = np.random.default_rng(0)
    data = [{"input_ids": rng.integers(1, VOCAB, size=n).tolist()} for n in rng.integers(3, 9, BATCH * K * UPDATES)]
    return data, transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False, pad_to_multiple_of=8)


def test_accumulated_padded_gpt2_trains_as_hugging_face_s_trainer(tmp_path):
    """per_device_train_batch_size=2, gradient_accumulation_steps=3, AdamW (weight_decay=0.01; the Trainer exempts
    biases and LayerNorm weights), max_grad_norm=1.0, linear schedule with one warmup step, 3 updates. The
    Trainer's causal LM loss shifts the labels inside the model and divides each micro-batch's sum by the update's
    count of shifted labels (num_items_in_batch): onnxtrain gets the logits' cross-entropy on labels shifted by
    one (-100 last) and accumulate=3's default accumulate_by="items", the rates through fit's schedule."""
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2, n_positions=8,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                     bos_token_id=PAD, eos_token_id=PAD)
    start = perturbed(transformers.GPT2LMHeadModel(config))
    # the Trainer counts shifted labels for the loss types it knows to shift; GPT2LMHeadModel's name maps to none
    # (loss_type None), so it would count each row's first label too (one more per row) where it still shifts
    start.loss_type = "ForCausalLM"
    data, collator = padded_lm_batches()
    rates: list[float] = []

    class Rates(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
            rates.append(optimizer.param_groups[0]["lr"])

    class InOrder(transformers.Trainer):  # the micro-batches in the dataset's order, as fed to onnxtrain below
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], dataloader_num_workers=0, seed=0, save_strategy="no",
        logging_strategy="no", disable_tqdm=True, remove_unused_columns=False, per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=K, learning_rate=1e-3, weight_decay=0.01, max_grad_norm=1.0,
        lr_scheduler_type="linear", warmup_steps=1, max_steps=UPDATES)
    trained = copy.deepcopy(start).train()
    InOrder(model=trained, args=args, train_dataset=data, data_collator=collator, callbacks=[Rates()]).train()
    assert rates == pytest.approx([0.0, 1e-3, 5e-4])

    micro = [collator(data[i:i + BATCH]) for i in range(0, len(data), BATCH)]
    counts = [int(b["labels"][:, 1:].ne(-100).sum()) for b in micro]
    assert len(set(counts)) > 1  # micro-batches of different weights: accumulate_by matters
    feeds = [{"input_ids": b["input_ids"].numpy(), "attention_mask": b["attention_mask"].numpy(),
              "target": np.pad(b["labels"].numpy()[:, 1:], ((0, 0), (0, 1)), constant_values=-100)} for b in micro]
    model = onnxtrain.from_torch(Logits(copy.deepcopy(start), ("input_ids", "attention_mask")).eval(),
                                 (micro[0]["input_ids"], micro[0]["attention_mask"]),
                                 input_names=["input_ids", "attention_mask"], loss="cross_entropy", class_axis=-1,
                                 optimizer="adamw", weight_decay=0.01, no_decay=True, clip_grad_norm=1.0,
                                 accumulate=K)
    engine = onnxtrain.load(model)
    # fit's schedule numbers optimizer updates, as the Trainer's scheduler: the Trainer's rates, one per update
    onnxtrain.fit(engine, feeds, len(feeds), learning_rate=lambda update: rates[update], progress=False)
    ours = Logits(copy.deepcopy(start), ("input_ids", "attention_mask"))
    assert onnxtrain.to_torch(engine, ours) == []
    theirs = {n: p.detach() for n, p in trained.named_parameters()}
    moved = max(float((theirs[n] - p.detach()).abs().max()) for n, p in start.named_parameters())
    assert moved > 1e-3
    for name, value in ours.model.named_parameters():
        np.testing.assert_allclose(value.detach().numpy(), theirs[name].numpy(), rtol=0, atol=1e-5,
                                   err_msg=name)
