"""The reference's log-probs (runner/components/objectives/reference.py): scored in shares
that cover every pair once, and with the adapters off equal to the base model alone."""

from __future__ import annotations

import copy
from dataclasses import replace
from types import SimpleNamespace

import torch

from runner.components.data.preference_batch import pad_pairs
from runner.components.objectives.reference import AdapterOff, Precomputed, score_pairs, sequence_logps


def tiny_gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=97, n_embd=16, n_layer=1, n_head=2, n_positions=32,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)).eval()


def pairs(count: int) -> list[dict]:
    generator = torch.Generator().manual_seed(1)
    rows = []
    for index in range(count):
        prompt = torch.randint(0, 97, (2 + index % 3,), generator=generator).tolist()
        chosen = torch.randint(0, 97, (1 + index % 4,), generator=generator).tolist()
        rejected = torch.randint(0, 97, (3,), generator=generator).tolist()
        rows.append({"chosen_input_ids": prompt + chosen, "chosen_labels": [-100] * len(prompt) + chosen,
                     "rejected_input_ids": prompt + rejected, "rejected_labels": [-100] * len(prompt) + rejected,
                     "pair_index": index})
    return rows


def one_process() -> SimpleNamespace:
    return SimpleNamespace(num_processes=1, process_index=0, device=torch.device("cpu"), is_main_process=True,
                           gather=lambda t: t, wait_for_everyone=lambda: None)


def test_the_table_holds_every_pairs_own_log_probs_whatever_the_batch():
    """7 pairs in batches of 3 (the last batch short) and of 1: each row of the table is
    that pair's log-probs scored alone."""
    model, rows = tiny_gpt2(), pairs(7)
    collate = lambda batch: pad_pairs(batch, pad_id=0)  # noqa: E731
    alone = torch.stack([sequence_logps(model, collate([row]))[0] for row in rows])  # [7, 2]
    for batch_size in (3, 1):
        table = score_pairs(model, rows, collate, batch_size, one_process(), cache=True)
        torch.testing.assert_close(table, alone.float(), rtol=0, atol=1e-5)
    looked_up = Precomputed({"train": table}, scored=True).logps(model, collate([rows[5], rows[2]]), "train")
    torch.testing.assert_close(looked_up, torch.stack([table[5, 0], table[2, 0], table[5, 1], table[2, 1]]))


def test_the_adapters_off_give_the_base_models_log_probs_not_the_adapted_ones():
    from peft import LoraConfig, get_peft_model

    base = tiny_gpt2()
    adapted = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"],
                                                             fan_in_fan_out=True))
    with torch.no_grad():  # trained adapters: B is no longer zero
        for name, parameter in adapted.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    batch = pad_pairs(pairs(4), pad_id=0)
    off = AdapterOff(adapted, cache=True).logps(adapted, batch, "train")
    with torch.no_grad():
        torch.testing.assert_close(off, sequence_logps(base, batch)[0], rtol=0, atol=1e-6)
        assert (sequence_logps(adapted, batch)[0] - off).abs().max() > 1e-3  # the adapters do move them


def test_a_table_is_shared_beside_the_data_and_the_run_folder_keeps_its_own(tmp_path):
    """The first run scores the pairs and writes its table to its run folder and beside the
    prepared data; a second run of the same key reads the shared one (no forward) into its
    own folder; its resume reads its folder even when the shared cache is gone; another key
    (other weights, precision or data) scores again."""
    from runner.components.objectives.reference import TABLE_FILE, precomputed_tables

    model, rows = tiny_gpt2(), pairs(5)
    forwards = []
    model.register_forward_hook(lambda *args: forwards.append(1))
    collate = lambda batch: pad_pairs(batch, pad_id=0)  # noqa: E731
    shared = tmp_path / "data" / "reference_logps"

    def tables(run: str, key: str = "k1"):
        forwards.clear()
        found, origin = precomputed_tables(model, {"train": rows}, collate, 2, one_process(), tmp_path / run, key,
                                           shared, cache=True)
        return found["train"], origin, len(forwards)

    first, origin, ran = tables("one")
    assert (origin, ran) == ("scored", 3) and len(list(shared.glob("*.pt"))) == 1
    again, origin, ran = tables("two")
    assert (origin, ran) == ("shared", 0) and torch.equal(again, first)
    assert (tmp_path / "two" / TABLE_FILE).exists()
    for table in shared.glob("*.pt"):
        table.unlink()
    resumed, origin, ran = tables("two")
    assert (origin, ran) == ("run folder", 0) and torch.equal(resumed, first)
    _, origin, ran = tables("three", key="k2")
    assert (origin, ran) == ("scored", 3) and len(list(shared.glob("*.pt"))) == 1


def test_the_key_names_the_data_the_starting_weights_and_the_precision(tmp_path):
    from runner.components.objectives.reference import describe_key
    from runner.config.spec import ModelSpec

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"x" * 10)
    data, sizes = tmp_path / "cache" / "abc123", {"train": 5, "validation": 2}
    key = describe_key(data, ModelSpec(name_or_path=str(folder)), 0, "fp32", sizes)
    assert key == describe_key(data, ModelSpec(name_or_path=str(folder)), 1, "fp32", sizes)  # the seed: not a folder's
    others = [describe_key(data, ModelSpec(name_or_path=str(folder)), 0, "bf16", sizes),
              describe_key(tmp_path / "cache" / "other", ModelSpec(name_or_path=str(folder)), 0, "fp32", sizes),
              describe_key(data, ModelSpec(name_or_path=str(folder)), 0, "fp32", {"train": 4, "validation": 2}),
              describe_key(data, ModelSpec(), 0, "fp32", sizes), describe_key(data, ModelSpec(), 1, "fp32", sizes)]
    (folder / "model.safetensors").write_bytes(b"y" * 11)  # retrained into the same folder
    others.append(describe_key(data, ModelSpec(name_or_path=str(folder)), 0, "fp32", sizes))
    assert len({key, *others}) == 1 + len(others)


def test_the_key_names_everything_that_changes_the_reference_log_probs(tmp_path):
    """model.config_overrides on a pretrained model changes the function the weights compute
    (issue 61, 2); kernels that compute the same function to float rounding (attention,
    activations, compile, the chunked head) share one table, as layouts do."""
    from runner.components.objectives.reference import describe_key
    from runner.config.spec import AttnImplementation, ModelSpec

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"x" * 10)
    data, sizes = tmp_path / "cache" / "abc123", {"train": 5, "validation": 2}
    plain = ModelSpec(name_or_path=str(folder))
    keys = {describe_key(data, spec, 0, "fp32", sizes) for spec in [
        plain, replace(plain, config_overrides="layer_norm_epsilon=0.5"),
        replace(plain, config_overrides="layer_norm_epsilon=0.25")]}
    assert len(keys) == 3
    same = replace(plain, gradient_checkpointing=True, compile=True, chunked_loss=False, fused_activations=False,
                   attn_implementation=AttnImplementation.eager)
    assert describe_key(data, same, 0, "fp32", sizes) == describe_key(data, plain, 0, "fp32", sizes)
