//! Sparsity configuration and model geometry: LServe's defaults and every validation rule.

use lserve::config::{GqaAggregation, SparsityConfig};
use lserve::geometry::ModelGeometry;
use lserve::LserveError;

fn field_of(r: lserve::Result<()>) -> &'static str {
    match r {
        Err(LserveError::InvalidConfig { field, .. }) => field,
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
}

#[test]
fn defaults_are_lservers() {
    let c = SparsityConfig::default();
    assert_eq!(c.sink_tokens, 64);
    assert_eq!(c.local_tokens, 256);
    assert_eq!(c.token_budget, 4096);
    assert_eq!(c.page_tokens, 64);
    assert_eq!(c.logical_page_tokens, 16);
    assert_eq!(c.reuse_interval, 4);
    assert_eq!(c.dynamic_min_len, 2 * c.token_budget);
    assert_eq!(c.gqa_aggregation, GqaAggregation::Max);
    assert_eq!(GqaAggregation::default(), GqaAggregation::Max);
    assert!(c.always_include_first_page);
    assert_eq!(c.softmax_scale, None);
    c.validate().unwrap();
    assert_eq!(c.pages_per_selection(), 64);
    assert_eq!(c.logical_per_page(), 4);
    assert_eq!(c.streaming_rows(), 320);
    assert_eq!(c.pages_for_len(0), 0);
    assert_eq!(c.pages_for_len(64), 1);
    assert_eq!(c.pages_for_len(65), 2);
    assert!((c.softmax_scale_for(128) - 1.0 / 128f32.sqrt()).abs() < 1e-7);
    assert!(!c.uses_page_selection(8192));
    assert!(c.uses_page_selection(8193));
    assert!(c.is_selection_step(0) && c.is_selection_step(8));
    assert!(!c.is_selection_step(1) && !c.is_selection_step(7));
}

#[test]
fn explicit_softmax_scale_is_used() {
    let c = SparsityConfig {
        softmax_scale: Some(0.25),
        ..Default::default()
    };
    c.validate().unwrap();
    assert_eq!(c.softmax_scale_for(128), 0.25);
}

#[test]
fn each_rule_is_checked() {
    let d = SparsityConfig::default();
    let cases: [(SparsityConfig, &str); 12] = [
        (
            SparsityConfig {
                page_tokens: 0,
                ..d
            },
            "page_tokens",
        ),
        (
            SparsityConfig {
                logical_page_tokens: 0,
                ..d
            },
            "logical_page_tokens",
        ),
        (
            SparsityConfig {
                logical_page_tokens: 24,
                ..d
            },
            "logical_page_tokens",
        ),
        (
            SparsityConfig {
                logical_page_tokens: 128,
                ..d
            },
            "logical_page_tokens",
        ),
        (
            SparsityConfig {
                token_budget: 0,
                ..d
            },
            "token_budget",
        ),
        (
            SparsityConfig {
                token_budget: 4000,
                ..d
            },
            "token_budget",
        ),
        (
            SparsityConfig {
                local_tokens: 0,
                ..d
            },
            "local_tokens",
        ),
        (
            SparsityConfig {
                reuse_interval: 0,
                ..d
            },
            "reuse_interval",
        ),
        (
            SparsityConfig {
                softmax_scale: Some(0.0),
                ..d
            },
            "softmax_scale",
        ),
        (
            SparsityConfig {
                softmax_scale: Some(-1.0),
                ..d
            },
            "softmax_scale",
        ),
        (
            SparsityConfig {
                softmax_scale: Some(f32::NAN),
                ..d
            },
            "softmax_scale",
        ),
        (
            SparsityConfig {
                softmax_scale: Some(f32::INFINITY),
                ..d
            },
            "softmax_scale",
        ),
    ];
    for (c, field) in cases {
        assert_eq!(field_of(c.validate()), field, "{c:?}");
    }
}

#[test]
fn edge_values_that_are_valid() {
    let d = SparsityConfig::default();
    for c in [
        SparsityConfig {
            sink_tokens: 0,
            ..d
        },
        SparsityConfig {
            local_tokens: 1,
            ..d
        },
        SparsityConfig {
            logical_page_tokens: 64,
            ..d
        },
        SparsityConfig {
            logical_page_tokens: 1,
            ..d
        },
        SparsityConfig {
            token_budget: 64,
            ..d
        },
        SparsityConfig {
            reuse_interval: 1,
            ..d
        },
        SparsityConfig {
            dynamic_min_len: 0,
            ..d
        },
        SparsityConfig {
            gqa_aggregation: GqaAggregation::Mean,
            ..d
        },
        SparsityConfig {
            softmax_scale: Some(1e-3),
            ..d
        },
    ] {
        c.validate().unwrap_or_else(|e| panic!("{c:?}: {e}"));
    }
}

#[test]
fn random_configs_validate_iff_the_rules_hold() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed);
    let (mut ok, mut bad) = (0, 0);
    for _ in 0..2000 {
        let c = SparsityConfig {
            sink_tokens: rng.gen_range(0..200),
            local_tokens: rng.gen_range(0..300),
            token_budget: rng.gen_range(0..5) * 64 + rng.gen_range(0..2) * rng.gen_range(0..64),
            page_tokens: [0, 16, 32, 64][rng.gen_range(0..4)],
            logical_page_tokens: [0, 8, 16, 24, 64][rng.gen_range(0..5)],
            reuse_interval: rng.gen_range(0..5),
            dynamic_min_len: rng.gen_range(0..10_000),
            gqa_aggregation: GqaAggregation::Max,
            always_include_first_page: rng.gen(),
            softmax_scale: [None, Some(0.1), Some(0.0), Some(f32::NAN)][rng.gen_range(0..4)],
            stats_format: Default::default(),
            selection_unit: Default::default(),
        };
        let expect_ok = c.page_tokens > 0
            && c.logical_page_tokens > 0
            && c.page_tokens.is_multiple_of(c.logical_page_tokens)
            && c.token_budget > 0
            && c.token_budget.is_multiple_of(c.page_tokens)
            && c.local_tokens > 0
            && c.reuse_interval >= 1
            && c.softmax_scale.is_none_or(|s| s.is_finite() && s > 0.0);
        assert_eq!(c.validate().is_ok(), expect_ok, "{c:?}");
        if expect_ok {
            ok += 1;
        } else {
            bad += 1;
        }
    }
    assert!(ok > 50 && bad > 50, "ok {ok}, bad {bad}");
}

#[test]
fn geometry_presets_and_rules() {
    let l3 = ModelGeometry::llama3_8b();
    assert_eq!(
        (l3.layers(), l3.q_heads(), l3.kv_heads(), l3.head_dim()),
        (32, 32, 8, 128)
    );
    assert_eq!(l3.group(), 4);
    assert_eq!(l3.kv_head_of(7), 1);
    let l2 = ModelGeometry::llama2_7b();
    assert_eq!(
        (l2.layers(), l2.q_heads(), l2.kv_heads(), l2.head_dim()),
        (32, 32, 32, 128)
    );
    assert_eq!(l2.group(), 1);
    assert_eq!(ModelGeometry::new(32, 32, 8, 128).unwrap(), l3);
    for d in [64, 128] {
        ModelGeometry::new(2, 4, 2, d).unwrap();
    }
    for (args, field) in [
        ((0, 4, 2, 64), "layers"),
        ((1, 0, 2, 64), "q_heads"),
        ((1, 4, 0, 64), "kv_heads"),
        ((1, 4, 2, 0), "head_dim"),
        ((1, 4, 3, 64), "kv_heads"),
        ((1, 2, 4, 64), "kv_heads"),
        ((1, 4, 2, 96), "head_dim"),
        ((1, 4, 2, 256), "head_dim"),
        ((1, 4, 2, 512), "head_dim"),
        ((1, 9, 1, 64), "group"),
        ((1, 64, 4, 128), "group"),
    ] {
        let r = ModelGeometry::new(args.0, args.1, args.2, args.3).map(|_| ());
        assert_eq!(field_of(r), field, "{args:?}");
    }
}

/// The geometry accepts every GQA group the kernels serve (1 to 8, including the
/// non-power-of-two groups of real models) at both head dimensions, and rejects the next group
/// up at construction, whatever the head count.
#[test]
fn geometry_accepts_groups_one_to_eight_only() {
    assert_eq!(ModelGeometry::MAX_GROUP, 8);
    assert_eq!(ModelGeometry::SUPPORTED_HEAD_DIMS, [64, 128]);
    // SmolLM2-135M (9 query heads over 3 KV heads, D 64), Qwen2.5-7B (28 over 4, D 128).
    assert_eq!(ModelGeometry::new(30, 9, 3, 64).unwrap().group(), 3);
    assert_eq!(ModelGeometry::new(28, 28, 4, 128).unwrap().group(), 7);
    for d in [64, 128] {
        for kv in [1, 2, 3, 8] {
            for group in 1..=8 {
                let g = ModelGeometry::new(1, kv * group, kv, d).unwrap();
                assert_eq!((g.group(), g.kv_head_of(kv * group - 1)), (group, kv - 1));
            }
            for group in [9, 12, 16, 64] {
                let r = ModelGeometry::new(1, kv * group, kv, d).map(|_| ());
                assert_eq!(field_of(r), "group", "kv {kv} group {group} d {d}");
            }
        }
    }
}

/// The size helpers are callable on a config `validate` rejects (their sums would overflow):
/// they saturate at `usize::MAX` instead of panicking, `validate` names the field, and what
/// sizes index tables from a config (`IndexTables::entry_capacity_for`) stays bounded.
#[test]
fn helpers_on_unvalidated_configs_saturate() {
    use lserve::index_table::IndexTables;

    let d = SparsityConfig::default();
    let huge_budget = SparsityConfig {
        token_budget: usize::MAX,
        page_tokens: 1,
        logical_page_tokens: 1,
        ..d
    };
    assert_eq!(field_of(huge_budget.validate()), "token_budget");
    assert_eq!(huge_budget.pages_per_selection(), usize::MAX);
    assert_eq!(huge_budget.held_selection_pages(), usize::MAX);
    assert_eq!(huge_budget.selection_entry_pages(), usize::MAX);
    assert_eq!(IndexTables::entry_capacity_for(&huge_budget, 100), 100);
    let near = SparsityConfig {
        token_budget: usize::MAX - 1,
        ..huge_budget
    };
    assert_eq!(near.held_selection_pages(), usize::MAX);
    assert_eq!(near.selection_entry_pages(), usize::MAX);
    for (sink, local, field) in [
        (usize::MAX, 1, "sink_tokens"),
        (1, usize::MAX, "local_tokens"),
        (usize::MAX, usize::MAX, "sink_tokens"),
    ] {
        let c = SparsityConfig {
            sink_tokens: sink,
            local_tokens: local,
            ..d
        };
        assert_eq!(c.streaming_rows(), usize::MAX);
        assert_eq!(field_of(c.validate()), field);
    }
    // The sum past u32 with both parts fitting is the sum's own rule.
    let c = SparsityConfig {
        sink_tokens: u32::MAX as usize,
        local_tokens: 1,
        ..d
    };
    assert_eq!(c.streaming_rows(), u32::MAX as usize + 1);
    assert_eq!(field_of(c.validate()), "sink_tokens + local_tokens");
}
