"""fusedhead.transformers against transformers' own code (not a transcription): tiny models of each family built
from their config classes (random weights: 2 layers, hidden 64, vocabulary 32000), stock vs patched on the same
batch, and transformers' ForCausalLMLoss called directly on materialized logits vs fusedhead.torch.causal_lm_loss.
The versions are those of python/requirements-test.txt (transformers 5.24.0, peft 0.21.2); without transformers
(Debian's torch 1.13 interpreter) the module is skipped.

Tolerances (conftest's float32 ones: both sides compute in fp32, fusedhead's GEMM and reduction rounding against
torch's): loss rtol 1e-5 (LOSS_RTOL_F32), every gradient normwise 1e-4 (GRAD_RTOL_F32): the last hidden state's,
lm_head's (or the tied embedding's, which also collects the embedding lookup's gradient) and every body parameter's.
bf16 models: see test_bf16_model.
"""
from __future__ import annotations

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="transformers not importable (.venv has it, "
                                   "python/requirements-test.txt; Debian's python3 does not)")
import torch.nn.functional as F  # noqa: E402
from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402

import fusedhead  # noqa: E402
import fusedhead.transformers as fhtr  # noqa: E402
from fusedhead.torch import causal_lm_loss  # noqa: E402
from conftest import GRAD_RTOL_F32, LOSS_RTOL_F32, normwise  # noqa: E402

V, H, B, T = 32000, 64, 2, 12
COMMON = dict(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)


def _config(family):
    """A tiny config of the family, dropout off; the head options set away from 1 / off where the family has one."""
    c = transformers
    if family == "llama":
        return c.LlamaConfig(**COMMON)
    if family == "mistral":
        return c.MistralConfig(**COMMON)
    if family == "qwen2":
        return c.Qwen2Config(**COMMON)
    if family == "qwen3":
        return c.Qwen3Config(**COMMON, head_dim=16)
    if family == "gemma":  # tied embeddings, no softcapping
        return c.GemmaConfig(**COMMON, head_dim=16)
    if family == "gemma2":  # tied embeddings, final_logit_softcapping 30 by default: 3 to make it bite
        return c.Gemma2Config(**COMMON, head_dim=16, final_logit_softcapping=3.0)
    if family == "gemma3":
        return c.Gemma3TextConfig(**COMMON, head_dim=16, final_logit_softcapping=3.0)
    if family == "cohere":  # logits * logit_scale
        return c.CohereConfig(**COMMON, logit_scale=0.5)
    if family == "granite":  # logits / logits_scaling
        return c.GraniteConfig(**COMMON, logits_scaling=4.0)
    if family == "phi":  # lm_head with a bias
        kw = dict(COMMON)
        return c.PhiConfig(**kw, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)
    if family == "gpt2":  # lm_head tied to transformer.wte
        return c.GPT2Config(vocab_size=V, n_embd=H, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0)
    raise KeyError(family)


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "cohere", "granite", "phi", "gpt2"]


def build(family, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_config(family))
    if family == "phi":  # a visible bias (initialised to 0)
        with torch.no_grad():
            model.lm_head.bias.normal_(0, 0.5)
    return model.to(dtype).train()


def batch(seed=1, ignore=-100):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    labels = ids.clone()
    labels[:, :3] = ignore          # a masked prompt
    labels[1, -4:] = ignore         # padding
    return ids, labels


def run(model, ids, labels, **kw):
    """loss, {name: grad} for every parameter, and the last hidden state's gradient (a hook on the body)."""
    kept = []
    body = model.base_model

    def keep(_module, _args, out):
        out.last_hidden_state.retain_grad()
        kept.append(out.last_hidden_state)

    handle = body.register_forward_hook(keep)
    try:
        out = model(input_ids=ids, labels=labels, **kw)
    finally:
        handle.remove()
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads, kept[0].grad


def compare(stock, fused, loss_rtol, grad_rtol):
    (o1, g1, h1), (o2, g2, h2) = stock, fused
    assert o2.logits is None and o1.logits is not None
    assert abs(o2.loss.item() - o1.loss.item()) <= loss_rtol * abs(o1.loss.item()), (o2.loss.item(), o1.loss.item())
    assert sorted(g1) == sorted(g2)
    assert normwise(h2.float().numpy(), h1.float().numpy()) <= grad_rtol
    for name in g1:
        assert normwise(g2[name].float().numpy(), g1[name].float().numpy()) <= grad_rtol, name


@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_stock(family):
    model = build(family)
    patched = fhtr.patch(copy.deepcopy(model), strict=True)
    assert fhtr.is_patched(patched) and not fhtr.is_patched(model)
    if family in ("gpt2", "gemma", "gemma2", "gemma3"):  # tied: the gradient must reach the embedding through the head
        assert patched.lm_head.weight is patched.get_input_embeddings().weight
    ids, labels = batch()
    compare(run(model, ids, labels), run(patched, ids, labels), LOSS_RTOL_F32, GRAD_RTOL_F32)


@pytest.mark.parametrize("option", ["num_items_int", "num_items_tensor", "shift_labels", "ignore_index"])
def test_loss_options_through_the_model(option):
    """The options the Trainer and TRL pass with the labels (kwargs that the model hands to its loss function)."""
    model = build("gemma2")
    patched = fhtr.patch(copy.deepcopy(model), strict=True)
    ids, labels = batch(ignore=-1 if option == "ignore_index" else -100)
    kw = {"num_items_int": dict(num_items_in_batch=37), "num_items_tensor": dict(num_items_in_batch=torch.tensor(23)),
          "shift_labels": dict(shift_labels=torch.cat([labels[:, 1:], torch.full((B, 1), -100)], 1)),
          "ignore_index": dict(ignore_index=-1)}[option]
    compare(run(model, ids, labels, **kw), run(patched, ids, labels, **kw), LOSS_RTOL_F32, GRAD_RTOL_F32)


def test_bf16_model():
    """A bf16 model: the same body, the head in bf16. Stock rounds the logits to bf16 (relative 2^-9) and the logits'
    gradient to bf16 before its GEMMs; fusedhead keeps both in fp32 until its bf16 outputs. Bounds: loss 2^-8
    relative; gradients normwise 3e-2 (measured up to 1e-2: stock's bf16 dlogits, carried into a bf16 body)."""
    model = build("gemma2", dtype=torch.bfloat16)
    patched = fhtr.patch(copy.deepcopy(model), strict=True)
    ids, labels = batch()
    stock, fused = run(model, ids, labels), run(patched, ids, labels)
    assert fused[0].loss.dtype == torch.float32
    compare(stock, fused, 2.0 ** -8, 3e-2)


def test_cpu_autocast_bf16():
    """An fp32 model under CPU autocast to bf16 (the Trainer's bf16=True on CPU): the head's inputs cast to bf16 as
    autocast's linear casts them; the fp32 weight collects the gradient. Bounds as test_bf16_model."""
    model = build("llama")
    patched = fhtr.patch(copy.deepcopy(model), strict=True)
    ids, labels = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        stock = run(model, ids, labels)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = run(patched, ids, labels)
    assert patched.lm_head.weight.grad.dtype == torch.float32
    compare(stock, fused, 2.0 ** -8, 3e-2)


def test_eval_generation_and_return_dict_untouched():
    model = build("cohere")
    patched = fhtr.patch(copy.deepcopy(model), strict=True)
    ids, labels = batch()
    model.eval()
    patched.eval()
    with torch.no_grad():
        a, b = model(input_ids=ids, labels=labels), patched(input_ids=ids, labels=labels)
        assert torch.equal(a.logits, b.logits) and torch.equal(a.loss, b.loss)
        g1 = model.generate(ids[:1, :5], max_new_tokens=4, do_sample=False)
        g2 = patched.generate(ids[:1, :5], max_new_tokens=4, do_sample=False)
    assert torch.equal(g1, g2)
    # training without labels: logits, no loss
    patched.train()
    assert patched(input_ids=ids).logits.shape == (B, T, V)
    # skip_logits (Liger's and the Trainer's name) forces either path; return_dict=False gives (loss, ...) without
    # logits
    patched.eval()
    with torch.no_grad():
        out = patched(input_ids=ids, labels=labels, skip_logits=True)
        assert out.logits is None and abs(out.loss.item() - a.loss.item()) <= LOSS_RTOL_F32 * a.loss.item()
    patched.train()
    t = patched(input_ids=ids, labels=labels, return_dict=False)
    model.train()
    t_stock = model(input_ids=ids, labels=labels, return_dict=False)
    assert isinstance(t, tuple) and len(t) == len(t_stock) - 1 and t[0].shape == ()
    assert not any(torch.is_tensor(x) and x.shape[-1:] == (V,) for x in t)
    assert patched(input_ids=ids, labels=labels, skip_logits=False).logits.shape == (B, T, V)
    fhtr.unpatch(patched)
    assert not fhtr.is_patched(patched) and "forward" not in patched.__dict__


@pytest.mark.parametrize("case", ["plain", "softcap", "logit_scale", "bias", "num_items_int", "num_items_tensor",
                                  "shift_labels", "ignore_index", "everything"])
def test_for_causal_lm_loss_directly(case):
    """transformers' ForCausalLMLoss on F.linear's logits (transformed as the models do) vs causal_lm_loss, for every
    option ForCausalLMLoss takes."""
    g = torch.Generator().manual_seed(7)
    n_vocab, h = 3001, 32
    hidden = torch.randn(B, T, h, generator=g)
    weight = torch.randn(n_vocab, h, generator=g) * (4.0 / h ** 0.5)
    bias = torch.randn(n_vocab, generator=g) * 0.5
    labels = torch.randint(0, n_vocab, (B, T), generator=g)
    ignore = -1 if case in ("ignore_index", "everything") else -100
    labels[:, :2] = ignore
    labels[0, -3:] = ignore
    loss_kw, head_kw = {}, {}
    if case in ("ignore_index", "everything"):
        loss_kw["ignore_index"] = -1
    if case in ("num_items_int", "everything"):
        loss_kw["num_items_in_batch"] = 31
    if case == "num_items_tensor":
        loss_kw["num_items_in_batch"] = torch.tensor(17)
    if case in ("shift_labels", "everything"):
        loss_kw["shift_labels"] = torch.cat([labels[:, 1:], torch.full((B, 1), ignore)], 1)
    if case in ("softcap", "everything"):
        head_kw["final_logit_softcapping"] = 3.0
    if case in ("logit_scale", "everything"):
        head_kw["logit_scale"] = 0.5
    use_bias = case in ("bias", "everything")
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    ref_leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    logits = F.linear(ref_leaves[0], ref_leaves[1], ref_leaves[2] if use_bias else None)
    if "logit_scale" in head_kw:
        logits = logits * head_kw["logit_scale"]
    if "final_logit_softcapping" in head_kw:
        c = head_kw["final_logit_softcapping"]
        logits = torch.tanh(logits / c) * c
    ref = ForCausalLMLoss(logits, labels, n_vocab, **loss_kw)
    got = causal_lm_loss(leaves[0], leaves[1], labels, bias=leaves[2] if use_bias else None, **loss_kw, **head_kw)
    assert abs(got.item() - ref.item()) <= LOSS_RTOL_F32 * abs(ref.item())
    ref.backward()
    got.backward()
    for a, b in zip(leaves, ref_leaves):
        if b.grad is None:
            assert a.grad is None
        else:
            assert normwise(a.grad.numpy(), b.grad.numpy()) <= GRAD_RTOL_F32


def test_trainer_gradient_accumulation():
    """transformers.Trainer, 2 optimizer steps of 2 micro-batches each (num_items_in_batch passed to the model), stock
    vs patched on the same batches: the logged losses and the final weights agree."""
    from torch.utils.data import Dataset

    class Data(Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            ids, labels = batch(seed=100 + i)
            labels[0, -1 - i % 5:] = -100    # a different token count per sample: the accumulation must weigh them
            return {"input_ids": ids[0], "labels": labels[0]}

    def train(model, out_dir):
        args = transformers.TrainingArguments(
            output_dir=str(out_dir), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2,
            learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0,
            dataloader_num_workers=0, disable_tqdm=True)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Data())
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    import tempfile
    model = build("granite")
    patched = fhtr.patch(copy.deepcopy(model), strict=True)
    with tempfile.TemporaryDirectory() as d:
        stock, fused = train(model, d), train(patched, d)
    assert len(stock) == 2 and all(abs(a - b) <= LOSS_RTOL_F32 * abs(a) for a, b in zip(stock, fused)), (stock, fused)
    for (name, p), q in zip(model.named_parameters(), patched.parameters()):
        assert normwise(q.detach().numpy(), p.detach().numpy()) <= 1e-5, name


# ---- loud routing -------------------------------------------------------------------------------------------------

def _tiny_opt():
    return transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=1000, hidden_size=32, num_hidden_layers=1, ffn_dim=64, num_attention_heads=2,
        word_embed_proj_dim=32, max_position_embeddings=32))


def test_unsupported_class_warns_or_raises():
    model = _tiny_opt()
    with pytest.warns(fhtr.RoutingWarning, match="OPTForCausalLM is not a model class"):
        assert fhtr.patch(model) is model
    assert not fhtr.is_patched(model)
    with pytest.raises(fhtr.NotRoutedError, match="OPTForCausalLM"):
        fhtr.patch(model, strict=True)


def test_subclass_overriding_forward_is_refused():
    class Scaled(transformers.LlamaForCausalLM):
        def forward(self, *args, **kwargs):  # e.g. a head that scales its logits: unknown to fusedhead
            return super().forward(*args, **kwargs)

    torch.manual_seed(0)
    model = Scaled(_config("llama"))
    with pytest.warns(fhtr.RoutingWarning, match="Scaled overrides the forward of LlamaForCausalLM"):
        fhtr.patch(model)
    with pytest.raises(fhtr.NotRoutedError):
        fhtr.patch(model, strict=True)


def test_custom_loss_function_is_refused():
    model = build("llama")
    model.loss_function = lambda logits, labels, vocab_size, **kw: logits.float().mean()
    with pytest.raises(fhtr.NotRoutedError, match="loss_function was set"):
        fhtr.patch(model, strict=True)


def test_head_hooks_and_call_time_refusals():
    """A hook on lm_head (added after patch) and a float16 model: warned once each, the stock loss returned."""
    model = fhtr.patch(build("llama"))
    ids, labels = batch()
    handle = model.lm_head.register_forward_hook(lambda m, a, o: None)
    with pytest.warns(fhtr.RoutingWarning, match="forward hooks") as record:
        out = model(input_ids=ids, labels=labels)
        model(input_ids=ids, labels=labels)
    assert len(record) == 1 and out.logits is not None
    handle.remove()
    model.half()
    with pytest.warns(fhtr.RoutingWarning, match="float16") as record:
        out = model(input_ids=ids, labels=labels)
    assert out.logits is not None and out.logits.dtype == torch.float16
    fhtr.patch(model, strict=True)   # patching again: the strict setting only
    with pytest.raises(fhtr.NotRoutedError, match="float16"):
        model(input_ids=ids, labels=labels)


def test_unknown_option_reaching_the_loss():
    """label_smoothing passed to the model reaches ForCausalLMLoss, which drops it: reported, not dropped silently."""
    model = fhtr.patch(build("llama"))
    ids, labels = batch()
    with pytest.warns(fhtr.RoutingWarning, match="label_smoothing"):
        model(input_ids=ids, labels=labels, label_smoothing=0.1)
    fhtr.patch(model, strict=True)
    with pytest.raises(fhtr.NotRoutedError, match="label_smoothing"):
        model(input_ids=ids, labels=labels, label_smoothing=0.1)


def test_probe_catches_an_unknown_transform(monkeypatch):
    """If a model's transform were not the table's (here: Granite's logits_scaling changed behind the table's back
    by faking the table), the loss raises instead of computing the plain loss."""
    model = fhtr.patch(build("granite"), strict=True)
    monkeypatch.setitem(fhtr._FAMILIES, "GraniteForCausalLM", fhtr._plain)
    ids, labels = batch()
    with pytest.raises(RuntimeError, match="transformed its logits"):
        model(input_ids=ids, labels=labels)


def test_peft_wrappers_on_the_head():
    peft = pytest.importorskip("peft", reason="peft not importable (python/requirements-test.txt installs it)")
    ids, labels = batch()
    # modules_to_save=["lm_head"]: the adapter's copy of the head trains, and gets fusedhead's gradient
    stock = peft.get_peft_model(build("llama"), peft.LoraConfig(
        r=4, target_modules=["q_proj"], modules_to_save=["lm_head"], lora_dropout=0.0))
    torch.manual_seed(3)
    with torch.no_grad():   # LoRA's B starts at 0: move it so that the adapters matter
        for n, p in stock.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    fused = fhtr.patch(copy.deepcopy(stock), strict=True)
    assert type(fused.base_model.model.lm_head).__name__ == "ModulesToSaveWrapper"
    o1, o2 = stock(input_ids=ids, labels=labels), fused(input_ids=ids, labels=labels)
    assert o2.logits is None
    assert abs(o1.loss.item() - o2.loss.item()) <= LOSS_RTOL_F32 * o1.loss.item()
    o1.loss.backward()
    o2.loss.backward()
    g1 = {n: p.grad for n, p in stock.named_parameters() if p.grad is not None}
    g2 = {n: p.grad for n, p in fused.named_parameters() if p.grad is not None}
    assert sorted(g1) == sorted(g2) and any("modules_to_save" in n for n in g1)
    for n in g1:
        assert normwise(g2[n].numpy(), g1[n].numpy()) <= GRAD_RTOL_F32, n
    # LoRA on lm_head itself: refused, naming it
    lora_head = peft.get_peft_model(build("llama"), peft.LoraConfig(r=4, target_modules=["lm_head"]))
    with pytest.warns(fhtr.RoutingWarning, match="LoRA or another adapter on the head"):
        fhtr.patch(lora_head)
    with pytest.raises(fhtr.NotRoutedError, match="LoRA"):
        fhtr.patch(lora_head, strict=True)


def test_compiled_patched_model():
    """torch.compile of a patched model (Granite: a logit transform): the loss and gradients of the eager patched model
    within the fp32 bounds (Inductor fuses the body's operations, so its rounding differs a little); and the probe's
    check runs compiled too: a transform that is not the table's raises when the compiled graph runs."""
    def step(model, call):
        out = call(input_ids=ids, labels=labels)
        out.loss.backward()
        return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model = fhtr.patch(build("granite"), strict=True)
    twin = copy.deepcopy(model)
    ids, labels = batch()
    eager_out, eager_grads = step(twin, twin)
    torch._dynamo.reset()
    out, grads = step(model, torch.compile(model))
    assert out.logits is None and sorted(grads) == sorted(eager_grads)
    assert abs(out.loss.item() - eager_out.loss.item()) <= LOSS_RTOL_F32 * abs(eager_out.loss.item())
    for name in eager_grads:
        assert normwise(grads[name].numpy(), eager_grads[name].numpy()) <= GRAD_RTOL_F32, name

    wrong = fhtr.patch(build("granite"), strict=True)
    fhtr._FAMILIES["GraniteForCausalLM"], saved = fhtr._plain, fhtr._FAMILIES["GraniteForCausalLM"]
    try:
        torch._dynamo.reset()
        with pytest.raises(RuntimeError, match="transformed its logits"):
            torch.compile(wrong)(input_ids=ids, labels=labels)
    finally:
        fhtr._FAMILIES["GraniteForCausalLM"] = saved
        torch._dynamo.reset()


def test_deepcopy_of_a_patched_model_runs_its_own_weights():
    """copy.deepcopy of a patched model (TRL's reference model, an EMA copy) is patched on its own: its forward runs
    the copy's weights (its gradients reach the copy's parameters, none the original's), equal to the stock loss on
    those weights; the patched forward keeps the model's signature (the Trainer reads it to keep its input columns)."""
    import inspect
    model = fhtr.patch(build("llama"), strict=True)
    assert "input_ids" in inspect.signature(model.forward).parameters
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.lm_head.weight.mul_(2.0)
    ids, labels = batch()
    out = twin(input_ids=ids, labels=labels)
    out.loss.backward()
    assert out.logits is None and twin.lm_head.weight.grad is not None
    assert all(p.grad is None for p in model.parameters())
    stock = fhtr.unpatch(copy.deepcopy(twin))
    assert not fhtr.is_patched(stock) and fhtr.is_patched(twin)
    want = stock(input_ids=ids, labels=labels).loss.item()
    assert abs(out.loss.item() - want) <= LOSS_RTOL_F32 * abs(want)
