"""What an import carries of a Megatron optimizer state, decided from the
checkpoint's key list and common state alone (the Mcore-saved cases:
tests/multirank/test_checkpoint_megatron_optimizer.py)."""
from megaresil.checkpoint.megatron.optimizer_state import carried_state, is_optimizer_key

MODEL = {"embedding.word_embeddings.weight": (384, 64), "decoder.layers.mlp.linear_fc2.weight":
         (2, 64, 96)}


def state(*names: str, shapes: dict = MODEL) -> dict:
    return {f"optimizer.state.{name}.{key}": shape for name in names for key, shape in
            shapes.items()}


def test_model_space_moments_are_carried_with_the_main_weights_and_the_groups_step():
    groups = {"param_groups": [{"step": 5.0}, {"step": 5.0}],
              "param_state_sharding_type": "fully_reshardable"}
    carried = carried_state(MODEL, {**MODEL, **state("param", "exp_avg", "exp_avg_sq")}, groups, 9)
    assert (carried.main, carried.moments, carried.adam_step) == ("optimizer.state.param.", True, 5)
    assert carried.note.startswith("optimizer state carried (fully_reshardable)")


def test_the_plain_optimizer_names_its_main_weights_fp32_param_and_has_no_group_step():
    carried = carried_state(MODEL, {**MODEL, **state("fp32_param", "exp_avg", "exp_avg_sq")},
                            {"optimizer": {"param_groups": [{"lr": 1.0}]}}, 9)
    assert (carried.main, carried.moments, carried.adam_step) == \
        ("optimizer.state.fp32_param.", True, 9)
    assert "Adam's step taken as the iteration, 9" in carried.note


def test_state_outside_model_space_is_left_out_naming_its_format_and_the_fix():
    flattened = {key: (1, 1, 100) for key in MODEL}  # each rank's flattened range
    carried = carried_state(MODEL, {**MODEL, **state("exp_avg", "exp_avg_sq", shapes=flattened)},
                            {"param_state_sharding_type": "fully_sharded_model_space"}, 9)
    assert not carried.moments and "fully_sharded_model_space" in carried.note
    assert carried.note.endswith("--dist-ckpt-optim-fully-reshardable to carry it")
    one_moment = carried_state(MODEL, {**MODEL, **state("exp_avg")}, {}, 9)
    assert not one_moment.moments
    nothing = carried_state(MODEL, dict(MODEL), {}, 9)
    assert nothing.note == "no optimizer state in the checkpoint (saved with --no-save-optim)"


def test_a_chained_optimizers_prefixed_keys_are_optimizer_keys():
    assert is_optimizer_key("chained_1.optimizer.state.exp_avg.decoder.layers.mlp.router.weight")
    assert is_optimizer_key("optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_0.param")
    assert not is_optimizer_key("decoder.layers.mlp.linear_fc1.weight")
