//! AdamW with global gradient-norm clipping, written out so that its state
//! (step count and both moments of every parameter) can be checkpointed and
//! restored exactly; tch's built-in optimizers do not expose their state.

use std::collections::BTreeMap;

use tch::{Kind, Tensor};

#[derive(Debug, Clone, PartialEq)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

/// The optimizer over named parameters.
pub struct AdamW {
    pub config: AdamWConfig,
    /// Optimizer steps taken.
    pub step: u64,
    /// First and second moments by parameter name.
    moments: BTreeMap<String, (Tensor, Tensor)>,
}

#[derive(Debug, thiserror::Error)]
pub enum AdamWError {
    #[error("optimizer state has no moment for parameter `{0}`")]
    MissingMoment(String),
    #[error("optimizer state for `{name}` has shape {got:?}, the parameter {want:?}")]
    Shape {
        name: String,
        got: Vec<i64>,
        want: Vec<i64>,
    },
    #[error("invalid optimizer state: {0}")]
    State(String),
}

impl AdamW {
    pub fn new(config: AdamWConfig) -> Self {
        Self {
            config,
            step: 0,
            moments: BTreeMap::new(),
        }
    }

    /// Scales gradients so that their global L2 norm is at most `max_norm`
    /// (0: no clipping). Returns the norm before clipping.
    pub fn clip_grad_norm(params: &[(String, Tensor)], max_norm: f64) -> f64 {
        let _guard = tch::no_grad_guard();
        let mut sq = 0.0;
        for (_, p) in params {
            let g = p.grad();
            if g.defined() {
                sq += g
                    .to_kind(Kind::Double)
                    .square()
                    .sum(Kind::Double)
                    .double_value(&[]);
            }
        }
        let norm = sq.sqrt();
        if max_norm > 0.0 && norm > max_norm {
            let scale = max_norm / (norm + 1e-6);
            for (_, p) in params {
                let mut g = p.grad();
                if g.defined() {
                    let _ = g.g_mul_scalar_(scale);
                }
            }
        }
        norm
    }

    /// One AdamW step with learning rate `lr` on every parameter that has a gradient.
    pub fn step(&mut self, params: &[(String, Tensor)], lr: f64) {
        let _guard = tch::no_grad_guard();
        self.step += 1;
        let c = &self.config;
        let t = self.step as f64;
        let bc1 = 1.0 - c.beta1.powf(t);
        let bc2 = 1.0 - c.beta2.powf(t);
        for (name, p) in params {
            let g = p.grad();
            if !g.defined() {
                continue;
            }
            let (m, v) = self
                .moments
                .entry(name.clone())
                .or_insert_with(|| (p.zeros_like(), p.zeros_like()));
            let _ = m.g_mul_scalar_(c.beta1);
            let _ = m.g_add_(&(&g * (1.0 - c.beta1)));
            let _ = v.g_mul_scalar_(c.beta2);
            let _ = v.g_add_(&(g.square() * (1.0 - c.beta2)));
            let mut p = p.shallow_clone();
            if c.weight_decay > 0.0 {
                let _ = p.g_mul_scalar_(1.0 - lr * c.weight_decay);
            }
            let denom = (&*v / bc2).sqrt() + c.eps;
            let update = (&*m / bc1) / denom * lr;
            let _ = p.g_sub_(&update);
        }
    }

    /// Clears the gradients of `params`.
    pub fn zero_grad(params: &[(String, Tensor)]) {
        for (_, p) in params {
            let mut g = p.grad();
            if g.defined() {
                let _ = g.detach_().zero_();
            }
        }
    }

    /// The state as named tensors (`m.<name>`, `v.<name>`), for a checkpoint.
    pub fn state_tensors(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::with_capacity(self.moments.len() * 2);
        for (name, (m, v)) in &self.moments {
            out.push((format!("m.{name}"), m.shallow_clone()));
            out.push((format!("v.{name}"), v.shallow_clone()));
        }
        out
    }

    /// Restores the state written by [`AdamW::state_tensors`], checking it
    /// against the parameters.
    pub fn load_state(
        &mut self,
        step: u64,
        mut tensors: BTreeMap<String, Tensor>,
        params: &[(String, Tensor)],
    ) -> Result<(), AdamWError> {
        let mut moments = BTreeMap::new();
        if step > 0 {
            for (name, p) in params {
                let m = tensors.remove(&format!("m.{name}"));
                let v = tensors.remove(&format!("v.{name}"));
                let (Some(m), Some(v)) = (m, v) else {
                    return Err(AdamWError::MissingMoment(name.clone()));
                };
                for t in [&m, &v] {
                    if t.size() != p.size() {
                        return Err(AdamWError::Shape {
                            name: name.clone(),
                            got: t.size(),
                            want: p.size(),
                        });
                    }
                }
                let dev = p.device();
                moments.insert(
                    name.clone(),
                    (
                        m.to_device(dev).to_kind(p.kind()),
                        v.to_device(dev).to_kind(p.kind()),
                    ),
                );
            }
        }
        if let Some(extra) = tensors.keys().next() {
            return Err(AdamWError::State(format!("unexpected tensor `{extra}`")));
        }
        self.step = step;
        self.moments = moments;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    fn param(values: &[f32]) -> Tensor {
        Tensor::from_slice(values).set_requires_grad(true)
    }

    #[test]
    fn first_step_moves_each_weight_by_lr_against_its_gradient_sign() {
        // With bias correction, the first Adam update is lr · g/|g| (up to eps).
        let p = param(&[1.0, -2.0, 3.0]);
        let params = vec![("w".to_string(), p.shallow_clone())];
        let loss = (&p * Tensor::from_slice(&[2.0f32, -3.0, 0.5])).sum(Kind::Float);
        loss.backward();
        let mut opt = AdamW::new(AdamWConfig::default());
        opt.step(&params, 0.1);
        let got = Vec::<f32>::try_from(&p.detach()).unwrap();
        for (g, w) in got.iter().zip([0.9f32, -1.9, 2.9]) {
            assert!((g - w).abs() < 1e-5, "{got:?}");
        }
    }

    #[test]
    fn weight_decay_shrinks_weights_without_gradient_pressure() {
        let p = param(&[1.0]);
        let params = vec![("w".to_string(), p.shallow_clone())];
        (&p * 0.0).sum(Kind::Float).backward();
        let mut opt = AdamW::new(AdamWConfig {
            weight_decay: 0.5,
            ..Default::default()
        });
        opt.step(&params, 0.1);
        assert!((p.double_value(&[0]) - 0.95).abs() < 1e-6);
    }

    #[test]
    fn clipping_scales_the_global_norm() {
        let a = param(&[0.0, 0.0]);
        let b = param(&[0.0]);
        let params = vec![
            ("a".to_string(), a.shallow_clone()),
            ("b".to_string(), b.shallow_clone()),
        ];
        ((&a * Tensor::from_slice(&[3.0f32, 0.0])).sum(Kind::Float) + (&b * 4.0).sum(Kind::Float))
            .backward();
        let norm = AdamW::clip_grad_norm(&params, 1.0);
        assert!((norm - 5.0).abs() < 1e-6);
        let after = AdamW::clip_grad_norm(&params, 0.0);
        assert!((after - 1.0).abs() < 1e-4, "{after}");
    }

    #[test]
    fn state_round_trips_and_continues_identically() {
        let run = |restore: bool| -> Vec<f32> {
            let p = param(&[0.5, -0.5]);
            let params = vec![("w".to_string(), p.shallow_clone())];
            let mut opt = AdamW::new(AdamWConfig {
                weight_decay: 0.01,
                ..Default::default()
            });
            for i in 0..3 {
                AdamW::zero_grad(&params);
                (&p * (i as f64 + 1.0)).square().sum(Kind::Float).backward();
                opt.step(&params, 0.05);
                if restore && i == 1 {
                    let state: BTreeMap<String, Tensor> = opt
                        .state_tensors()
                        .into_iter()
                        .map(|(k, t)| (k, t.copy()))
                        .collect();
                    let mut fresh = AdamW::new(opt.config.clone());
                    fresh.load_state(opt.step, state, &params).unwrap();
                    opt = fresh;
                }
            }
            Vec::<f32>::try_from(&p.detach()).unwrap()
        };
        assert_eq!(run(false), run(true));
    }

    #[test]
    fn bad_state_is_refused() {
        let p = Tensor::zeros([2], (Kind::Float, Device::Cpu));
        let params = vec![("w".to_string(), p)];
        let mut opt = AdamW::new(AdamWConfig::default());
        let err = opt.load_state(3, BTreeMap::new(), &params).unwrap_err();
        assert!(matches!(err, AdamWError::MissingMoment(_)));
        let state = BTreeMap::from([
            (
                "m.w".to_string(),
                Tensor::zeros([3], (Kind::Float, Device::Cpu)),
            ),
            (
                "v.w".to_string(),
                Tensor::zeros([3], (Kind::Float, Device::Cpu)),
            ),
        ]);
        assert!(matches!(
            opt.load_state(3, state, &params),
            Err(AdamWError::Shape { .. })
        ));
    }
}
