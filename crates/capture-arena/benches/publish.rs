//! Publishing a batch from host buffers vs memcpy of the same bytes, side by side in one run
//! (issue target: publish >= 0.9 x memcpy): criterion groups, then the same three measured in
//! interleaved rounds with their ratios.
//!
//! `cargo bench -p capture-arena --bench publish`

use std::sync::Arc;
use std::time::{Duration, Instant};

use capture_arena::memory::ShmRegion;
use capture_arena::{Arena, Config, Dtype, Sample, Tensor, TensorData, Writer};
use criterion::{criterion_group, Criterion, Throughput};

/// A shared source buffer, so each iteration's samples borrow the same bytes without copying.
#[derive(Clone)]
struct Src(Arc<Vec<u8>>);
impl AsRef<[u8]> for Src {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

struct Shape {
    label: &'static str,
    samples: usize,
    tensors: Vec<(&'static str, Vec<u64>, Dtype)>,
}

fn shapes() -> Vec<Shape> {
    let l = 512u64;
    vec![
        Shape {
            label: "16 samples x 4 x 1MiB",
            samples: 16,
            tensors: (0..4)
                .map(|i| (["a", "b", "c", "d"][i], vec![1, 512, 1024], Dtype::Bfloat16))
                .collect(),
        },
        Shape {
            label: "16 samples EAGLE3-8B L=512",
            samples: 16,
            tensors: vec![
                ("hidden_state", vec![1, l, 3 * 4096], Dtype::Bfloat16),
                ("target", vec![1, l, 4096], Dtype::Bfloat16),
                ("input_ids", vec![1, l], Dtype::Int64),
                ("loss_mask", vec![1, l], Dtype::Int64),
            ],
        },
    ]
}

fn sources(s: &Shape) -> Vec<Vec<Src>> {
    (0..s.samples)
        .map(|i| {
            s.tensors
                .iter()
                .map(|(_, shape, dt)| {
                    let n = capture_arena::tensor::byte_len(shape, *dt).unwrap() as usize;
                    Src(Arc::new(vec![i as u8 + 1; n]))
                })
                .collect()
        })
        .collect()
}

fn batch(s: &Shape, src: &[Vec<Src>], replace: bool) -> Vec<Sample> {
    src.iter()
        .enumerate()
        .map(|(i, bufs)| {
            let mut smp = Sample::new("bench", &format!("s{i}"), 1)
                .unwrap()
                .with_replace(replace);
            for ((name, shape, dt), b) in s.tensors.iter().zip(bufs) {
                smp.push(
                    Tensor::new(*name, shape.clone(), *dt, TensorData::host(b.clone())).unwrap(),
                )
                .unwrap();
            }
            smp
        })
        .collect()
}

/// What the three measurements need for one batch shape: the sources, a memcpy destination, an
/// arena and a writer, each with the batch already resident (so every timed publish replaces).
struct Setup {
    src: Vec<Vec<Src>>,
    total: u64,
    dst: Vec<u8>,
    arena: Arena,
    writer: Writer,
}

fn setup(shape: &Shape) -> Setup {
    let src = sources(shape);
    let total: u64 = src.iter().flatten().map(|b| b.0.len() as u64).sum();
    let region = ShmRegion::create(total * 2).unwrap();
    let mut arena = Arena::new(Box::new(region), 256, "127.0.0.1:0".into()).unwrap();
    arena.publish(&batch(shape, &src, false)).unwrap().unwrap();
    let writer = Writer::start(&Config {
        arena_bytes: Some(total * 2),
        ..Config::default()
    })
    .unwrap();
    writer
        .submit(batch(shape, &src, false))
        .unwrap()
        .wait()
        .unwrap();
    Setup {
        dst: vec![1u8; total as usize],
        src,
        total,
        arena,
        writer,
    }
}

/// The limit: the same bytes copied into one pre-faulted buffer.
fn memcpy(src: &[Vec<Src>], dst: &mut [u8]) {
    let mut at = 0;
    for buf in src.iter().flatten() {
        dst[at..at + buf.0.len()].copy_from_slice(&buf.0);
        at += buf.0.len();
    }
    std::hint::black_box(dst);
}

fn publish(c: &mut Criterion) {
    for shape in shapes() {
        let Setup {
            src,
            total,
            mut dst,
            mut arena,
            writer,
        } = setup(&shape);
        let mut g = c.benchmark_group(shape.label);
        g.throughput(Throughput::Bytes(total))
            .sample_size(20)
            .measurement_time(Duration::from_secs(6));
        g.bench_function("memcpy", |b| b.iter(|| memcpy(&src, &mut dst)));
        // The arena alone: validate, allocate, copy, build results (replace frees the last copy).
        g.bench_function("arena publish", |b| {
            b.iter(|| arena.publish(&batch(&shape, &src, true)).unwrap().unwrap())
        });
        // Through the writer thread: submit, copy on the writer, wait for the results.
        g.bench_function("writer submit+wait", |b| {
            b.iter(|| {
                writer
                    .submit(batch(&shape, &src, true))
                    .unwrap()
                    .wait()
                    .unwrap()
            })
        });
        g.finish();
    }
}

/// The same three measurements, interleaved round by round (so a slow stretch of a shared
/// machine hits all of them alike), with medians and ratios printed.
fn interleaved(rounds: usize) {
    for shape in shapes() {
        let Setup {
            src,
            mut dst,
            mut arena,
            writer: w,
            ..
        } = setup(&shape);
        let mut t: [Vec<Duration>; 3] = Default::default();
        for _ in 0..rounds {
            let t0 = Instant::now();
            memcpy(&src, &mut dst);
            t[0].push(t0.elapsed());
            let b = batch(&shape, &src, true);
            let t0 = Instant::now();
            arena.publish(&b).unwrap().unwrap();
            t[1].push(t0.elapsed());
            let b = batch(&shape, &src, true);
            let t0 = Instant::now();
            w.submit(b).unwrap().wait().unwrap();
            t[2].push(t0.elapsed());
        }
        let [m, a, wr] = t.map(|mut v| {
            v.sort();
            v[v.len() / 2]
        });
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        println!(
            "interleaved {} ({} rounds): memcpy {:.2} ms, arena publish {:.2} ms ({:.3} x memcpy), \
             writer submit+wait {:.2} ms ({:.3} x memcpy)",
            shape.label,
            rounds,
            ms(m),
            ms(a),
            m.as_secs_f64() / a.as_secs_f64(),
            ms(wr),
            m.as_secs_f64() / wr.as_secs_f64()
        );
    }
}

criterion_group!(benches, publish);

fn main() {
    // `cargo test --benches` runs this without --bench: keep that run short.
    let full = std::env::args().any(|a| a == "--bench");
    benches();
    interleaved(if full { 40 } else { 2 });
    Criterion::default().configure_from_args().final_summary();
}
