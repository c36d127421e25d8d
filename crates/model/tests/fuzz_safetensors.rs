//! Fuzz target for the safetensors reader of saved models (`TensorFile::from_bytes` and
//! `load_flotilla_file`, what `flotilla generate` parses), with a fixed budget for CI
//! ([`CASES`] cases each, about a second): arbitrary bytes, bytes edited in a valid file's
//! header, and a valid file whose config metadata claims hostile sizes. Every input must be
//! refused or loaded without a panic, without building a layout or allocating more than the
//! file holds, and whatever loads has exactly its config's parameters.

use model::config::ModelConfig;
use model::interop::{TensorFile, TensorWriter, config_to_metadata, load_flotilla_file};
use model::layout::Layout;
use proptest::prelude::*;

/// Cases per target.
const CASES: u32 = 256;

/// A one-layer model's config.
fn tiny() -> ModelConfig {
    ModelConfig::gpt2(1, 2, 8, 4, 16)
}

/// A valid Flotilla file of `cfg`'s tensors (each filled with its index) whose metadata is
/// `meta`.
fn image(cfg: &ModelConfig, meta: std::collections::BTreeMap<String, String>) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.safetensors");
    let layout = Layout::new(cfg);
    let mut w = TensorWriter::new(&path);
    w.set_metadata("format", "pt");
    w.extend_metadata(meta);
    for e in &layout.entries {
        let v: Vec<f32> = e.range().map(|i| i as f32).collect();
        w.add_f32(&e.name, &e.shape, &v).unwrap();
    }
    w.write().unwrap();
    std::fs::read(&path).unwrap()
}

/// Parses and loads `bytes`: an error is fine, a panic is not; a load has its config's size.
fn load(bytes: Vec<u8>) -> Result<(), TestCaseError> {
    let Ok(f) = TensorFile::from_bytes("fuzz", bytes) else {
        return Ok(());
    };
    if let Ok((cfg, params)) = load_flotilla_file(&f) {
        prop_assert_eq!(params.len(), Layout::new(&cfg).total);
    }
    Ok(())
}

/// Values a hostile tool would put in a size field of the metadata.
fn hostile_size() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("0".to_string()),
        Just(u64::MAX.to_string()),
        Just((u64::MAX / 3).to_string()),
        Just((1u64 << 32).to_string()),
        Just("1000000000".to_string()),
        Just("-1".to_string()),
        Just("1e9".to_string()),
        (1u64..64).prop_map(|n| n.to_string()),
        any::<u64>().prop_map(|n| n.to_string()),
    ]
}

#[test]
fn the_valid_image_loads() {
    let cfg = tiny();
    let (read, params) = load_flotilla_file(
        &TensorFile::from_bytes("ok", image(&cfg, config_to_metadata(&cfg))).unwrap(),
    )
    .unwrap();
    assert_eq!(read, cfg);
    assert_eq!(params.len(), Layout::new(&cfg).total);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: CASES, ..ProptestConfig::default() })]

    /// Arbitrary bytes, some behind a plausible length prefix.
    #[test]
    fn arbitrary_bytes(rest in proptest::collection::vec(any::<u8>(), 0..1024), len in 0u64..1200) {
        load(rest.clone())?;
        let mut bytes = len.to_le_bytes().to_vec();
        bytes.extend_from_slice(&rest);
        load(bytes)?;
    }

    /// A valid file with bytes of its header (length prefix included) replaced.
    #[test]
    fn header_edits(edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..6)) {
        let cfg = tiny();
        let mut bytes = image(&cfg, config_to_metadata(&cfg));
        let header = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        for (at, b) in edits {
            bytes[at % header] = b;
        }
        load(bytes)?;
    }

    /// A valid file whose config metadata claims hostile sizes.
    #[test]
    fn hostile_config_sizes(
        picks in proptest::collection::vec(
            (prop::sample::select(vec!["layers", "d_model", "heads", "kv_heads", "ffn", "vocab",
                "seq_len"]), hostile_size()),
            1..4,
        ),
    ) {
        let cfg = tiny();
        let mut meta = config_to_metadata(&cfg);
        for (key, value) in picks {
            meta.insert(format!("{}{key}", model::interop::CONFIG_PREFIX), value);
        }
        load(image(&cfg, meta))?;
    }
}
