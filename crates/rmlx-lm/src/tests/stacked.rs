//! Linear layers over one input kept stacked (`Builder::linear_group`, `nn::Stacked`): the stacked
//! product equals the layers' own products side by side, dense and quantised, with biases; the
//! layers' weights are views of the stacked ones; and the group runs layer by layer (the stacked
//! product declines) once a layer has an adapter or a replaced weight, or in training mode.
//! Layers that are not alike are not stacked.

use crate::nn::{with_training, Builder, Linear, Lora, Module};
use crate::weights::{Weight, Weights};
use rmlx::quantization::{quantize, QuantMode};
use rmlx::{ops, random, Array, Dtype};

const OUTS: [i32; 3] = [64, 32, 32];
const NAMES: [&str; 3] = ["l.q_proj", "l.k_proj", "l.v_proj"];

fn normal(shape: &[i32], seed: u64) -> Array {
    random::normal(shape, Dtype::Float32, 0.0, 1.0, Some(&random::key(seed).unwrap())).unwrap()
}

/// Three layers of 64 inputs, dense (`quantized: None`) or quantised with `bits` (all alike, or the
/// last with other bits).
fn weights(quantized: Option<(i32, i32)>) -> Weights {
    let mut w = Weights::new();
    for (i, (name, out)) in NAMES.iter().zip(OUTS).enumerate() {
        let m = normal(&[out, 64], i as u64 + 1);
        let weight = match quantized {
            None => Weight::Dense(m),
            Some((bits, last_bits)) => {
                let b = if i == 2 { last_bits } else { bits };
                Weight::Quantized(quantize(&m, 32, b, QuantMode::Affine).unwrap())
            }
        };
        w.insert(format!("{name}.weight"), weight);
        w.insert(format!("{name}.bias"), Weight::Dense(normal(&[out], i as u64 + 10)));
    }
    w
}

fn max_abs_diff(a: &Array, b: &Array) -> f32 {
    (a - b).unwrap().abs().unwrap().max(rmlx::Axes::All, false).unwrap().item::<f32>().unwrap()
}

fn side_by_side(layers: &[Linear], x: &Array) -> Array {
    let ys: Vec<Array> = layers.iter().map(|l| l.forward(x).unwrap()).collect();
    ops::concatenate(&ys.iter().collect::<Vec<_>>(), 1).unwrap()
}

#[test]
fn stacked_product_equals_the_layers_and_declines_when_they_change() {
    rmlx::with_device(rmlx::Device::cpu(), || {
        let x = normal(&[3, 64], 99);
        for quantized in [None, Some((4, 4)), Some((8, 8))] {
            let mut b = Builder::new(weights(quantized), Dtype::Float32, false);
            let (mut layers, stacked) = b.linear_group(&NAMES, 64, &OUTS, true, &[crate::nn::Split::Whole; 3]).unwrap();
            assert!(b.remaining().is_empty(), "every tensor taken: {:?}", b.remaining());
            let stacked = stacked.expect("alike layers are stacked");
            // Only the stacked arrays are evaluated at load: weight (+ scales, biases) and the bias.
            let built = b.take_built();
            assert_eq!(built.len(), if quantized.is_some() { 4 } else { 2 }, "{quantized:?}");
            assert_eq!(built.last().unwrap().shape(), &[128]);
            let group: Vec<&Linear> = layers.iter().collect();
            let y = stacked.forward(&group, &x).unwrap().expect("an unchanged group runs stacked");
            assert_eq!(y.shape(), &[3, 128]);
            let want = side_by_side(&layers, &x);
            assert!(max_abs_diff(&y, &want) <= 1e-4, "{quantized:?}: off by {}", max_abs_diff(&y, &want));
            // The k projection's weight is rows 64..96 of the stacked one.
            let mut k_weight = None;
            layers[1].visit("", &mut |name, _, a| {
                if name == "weight" {
                    k_weight = Some(a.clone());
                }
            });
            assert_eq!(k_weight.unwrap().shape()[0], 32);

            // In training mode, the projections run one by one.
            assert!(with_training(|| stacked.forward(&group, &x)).unwrap().is_none());
            // An adapter on one of them.
            let lora = Lora::init(64, 32, 4, 2.0, Dtype::Float32, None).unwrap();
            layers[1].set_lora(Some(lora)).unwrap();
            let group: Vec<&Linear> = layers.iter().collect();
            assert!(stacked.forward(&group, &x).unwrap().is_none(), "{quantized:?}: adapter on k");
            layers[1].set_lora(None).unwrap();
            let group: Vec<&Linear> = layers.iter().collect();
            assert!(stacked.forward(&group, &x).unwrap().is_some(), "{quantized:?}: adapter removed");
            // A replaced weight (full fine-tuning, loaded parameters).
            layers[2].visit_mut("", &mut |name, a| {
                if name == "weight" {
                    *a = (&*a * 1.0).unwrap();
                }
            });
            let group: Vec<&Linear> = layers.iter().collect();
            assert!(stacked.forward(&group, &x).unwrap().is_none(), "{quantized:?}: weight replaced");
        }
        // Quantised with different bits: not stacked, and each layer as `Builder::linear` builds it.
        let mut b = Builder::new(weights(Some((4, 8))), Dtype::Float32, false);
        let (layers, stacked) = b.linear_group(&NAMES, 64, &OUTS, true, &[crate::nn::Split::Whole; 3]).unwrap();
        assert!(stacked.is_none());
        let mut single = Builder::new(weights(Some((4, 8))), Dtype::Float32, false);
        for (layer, (name, out)) in layers.iter().zip(NAMES.iter().zip(OUTS)) {
            let alone = single.linear(name, 64, out, true).unwrap();
            assert_eq!(max_abs_diff(&layer.forward(&x).unwrap(), &alone.forward(&x).unwrap()), 0.0, "{name}");
        }
    })
}
