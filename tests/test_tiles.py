"""The tile tables (grpo_fast/kernels/tiles.py): one rule maps a compute capability to its architecture class, every
table holds a row for every class, and the launch configurations, the tuning candidates and tools/sm_compile.py read
them."""

import dataclasses

import pytest
import torch

from grpo_fast.kernels import config as kconfig
from grpo_fast.kernels import tiles, tuning

BF16 = torch.bfloat16
# the cards a user runs, by compute capability, and the class each takes: the one rule, read back
CLASS_OF = {
    75: "sm80",  # Turing (below sm_80: the lowest class)
    80: "sm80",  # A100
    86: "sm89",  # RTX 3090, A10
    87: "sm89",  # Jetson Orin
    89: "sm89",  # RTX 4090, L40
    90: "sm90",  # H100, H200
    100: "sm100",  # B200
    103: "sm100",  # B300
    110: "sm100",  # Jetson Thor
    120: "sm120",  # RTX 5090
    121: "sm120",  # DGX Spark
}


@pytest.mark.parametrize("capability", sorted(CLASS_OF))
def test_one_rule_maps_every_card_to_its_class(capability):
    assert tiles.arch_class(capability).name == CLASS_OF[capability]


def test_the_row_every_card_takes():
    # what runs on a given card, family by family (bf16): its class's row, whatever the capability within the class
    for capability, name in CLASS_OF.items():
        for table in tiles.TABLES:
            assert table.row(BF16, capability) == table.rows[name], (table.family, capability)
            assert table.row(torch.float32, capability) == table.variants.get("fp32", {}).get(name, table.fp32)
    # the forward's launch on each card (config.gpu_record_config: the row, at most 128 columns off triton 3.6)
    for capability, name in CLASS_OF.items():
        row = tiles.RECORD.rows[name]
        config = kconfig.gpu_record_config(BF16, capability)
        assert (config.block_n, config.block_d, config.use_tma) == (row.block_n, row.block_d, row.use_tma)
        assert config.block_v == (row.block_v if kconfig.COLUMNS_256 else min(row.block_v, 128))


def test_every_table_has_a_row_for_every_class_and_variants_name_only_classes():
    assert list(tiles.ARCH_CLASSES) == list(tiles.ARCH_CLASS_NAMES)
    firsts = [c.first for c in tiles.ARCH_CLASSES.values()]
    assert firsts == sorted(firsts)  # the rule takes the highest first capability at or below a card's
    for c in tiles.ARCH_CLASSES.values():
        assert tiles.arch_class(c.first) is c and tiles.arch_class(c.capability) is c
    for table in tiles.TABLES:
        assert set(table.rows) == set(tiles.ARCH_CLASS_NAMES), table.family
        for variant, rows in table.variants.items():
            assert set(rows) <= set(tiles.ARCH_CLASS_NAMES), (table.family, variant)
        assert not table.fp32.use_tma  # IEEE fp32 dots on the FMA units: no copy-engine tile
    assert set(tiles.RECORD_VARIANTS) == set(tiles.ARCH_CLASS_NAMES)


def test_a_pointer_row_where_the_tensors_do_not_fit_the_copy_engine():
    for table in (tiles.SWEEP, tiles.G):
        for capability in (90, 100):
            row = table.row(BF16, capability, "pointer")
            assert not row.use_tma and row == table.variants["pointer"][tiles.arch_class(capability).name]
        assert table.row(BF16, 89, "pointer") == table.rows["sm89"]  # already a pointer row
    # a class without a pointer row of its own: its tile through pointers
    row = tiles.RECORD.row(BF16, 90, "pointer")
    assert row == dataclasses.replace(tiles.RECORD.rows["sm90"], use_tma=False)


def test_the_tuning_candidates_come_from_the_class():
    # the fixed row first, then its class's changes (tiles.RECORD_VARIANTS), none wider than the row, none twice
    for capability, name in CLASS_OF.items():
        default, *others = tuning.record_candidates(BF16, capability)
        assert default == kconfig.gpu_record_config(BF16, capability)
        assert 1 <= len(others) <= len(tiles.RECORD_VARIANTS[name]) and len(set(others)) == len(others)
        for candidate in others:
            assert candidate != default and candidate.block_v <= default.block_v
            changed = {
                f.name for f in dataclasses.fields(default) if getattr(candidate, f.name) != getattr(default, f.name)
            }
            assert any(changed <= set(change) for change in tiles.RECORD_VARIANTS[name]), (capability, changed)
