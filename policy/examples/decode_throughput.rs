//! Decoding throughput of the built-in tiny model on this machine:
//! `cargo run -p asyncrl-policy --example decode_throughput -- [slots] [new_tokens]`.

use std::time::Instant;

use asyncrl_policy::{
    DecodeBatch, DecodeBatchOptions, DeviceOptions, Policy, SamplingParams, SequenceRequest,
    TinyModelSpec,
};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let slots: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(32);
    let new_tokens: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(64);
    let opts = DeviceOptions::auto();
    let policy = Policy::builtin_tiny(&TinyModelSpec::default(), 0, opts)?;
    let tok = policy.tokenizer().ok_or("no tokenizer")?;
    let mut batch = DecodeBatch::new(
        &policy,
        DecodeBatchOptions {
            max_slots: slots,
            max_seq_len: new_tokens + 32,
        },
    )?;
    for i in 0..slots {
        let prompt = [
            vec![1],
            tok.encode(&format!("{}+{}=", i * 7, i * 13), false)?,
        ]
        .concat();
        batch.add(SequenceRequest {
            prompt,
            params: SamplingParams {
                max_new_tokens: new_tokens,
                seed: Some(i as u64),
                ..SamplingParams::default()
            },
        })?;
    }
    let start = Instant::now();
    let (mut tokens, mut steps) = (0usize, 0usize);
    while !batch.is_empty() {
        tokens += batch.step(&policy)?.sampled.len();
        steps += 1;
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "device {:?}, {} parameters, {slots} slots: {tokens} tokens in {steps} steps, {secs:.2} s, {:.0} tokens/s, {:.1} ms/step",
        policy.device(),
        policy.num_parameters(),
        tokens as f64 / secs,
        secs * 1000.0 / steps as f64
    );
    Ok(())
}
