//! The JSON the system takes in: the capture contract's request (`SampleSpec`, from the
//! inference server) built into a sample with small captured tensors, and a result (`Published`,
//! from a result line or a Python dict) checked the way a trainer checks it before it reads.
#![no_main]

use capture_arena::key::escape_part;
use capture_arena::sample::Captured;
use capture_arena::{Dtype, Published, Sample, SampleSpec, TensorData};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(spec) = serde_json::from_slice::<SampleSpec>(data) {
        // A small capture whose shape comes from the input: L = 1..=4 rows of 2 bf16.
        let rows = (data.len() % 4 + 1) as u64;
        let captured = || Captured {
            shape: vec![rows, 2],
            dtype: Dtype::Bfloat16,
            data: TensorData::host(vec![0u8; (rows * 4) as usize]),
        };
        if let Ok(sample) = Sample::from_spec(&spec, Some(captured()), Some(captured()), None) {
            // Every tensor of a built sample has a valid key under the spec's ids (encoded: any
            // id is accepted, and its key parts hold no '/').
            for key in sample.keys() {
                assert_eq!(key.store_id(), escape_part(&spec.store_id));
                assert_eq!(key.sample_id(), escape_part(&spec.sample_id));
                assert_eq!(key.as_str().split('/').count(), 4);
            }
        }
    }
    if let Ok(result) = serde_json::from_slice::<Published>(data) {
        if result.validate().is_ok() {
            // What validation promises: keys and sizes that a reader can compute safely.
            for (name, f) in &result.features {
                result.key(name).expect("a validated result has valid keys");
                let len = f
                    .byte_len()
                    .expect("a validated result's sizes do not overflow");
                // A stamped object's stamp lies after it, inside the address space.
                if f.stamp.is_some() {
                    assert!(f.address % 8 == 0);
                    assert!(f.address.checked_add(len.div_ceil(8) * 8 + 8).is_some());
                }
            }
        }
    }
});
