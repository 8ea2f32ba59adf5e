//! Bad input gives errors that say what went wrong, never panics.

use burn::tensor::{Distribution, Tensor};
use burn_flex::{Flex, FlexDevice};
use oxidiff_schedulers::{
    scheduler_from_config, AlgorithmType, DdimScheduler, NoNoise, RecordedNoise, Scheduler,
    SchedulerConfig, SchedulerError, SchedulerKind, TimestepOptions, TimestepSpacing, VarianceType,
};

type B = Flex;

const SD15: &str = r#"{
  "_class_name": "PNDMScheduler",
  "_diffusers_version": "0.6.0",
  "beta_end": 0.012,
  "beta_schedule": "scaled_linear",
  "beta_start": 0.00085,
  "num_train_timesteps": 1000,
  "set_alpha_to_one": false,
  "skip_prk_steps": true,
  "steps_offset": 1,
  "trained_betas": null,
  "clip_sample": false
}"#;

fn sd15() -> SchedulerConfig {
    SchedulerConfig::from_json_str(SD15, "sd15.json").unwrap()
}

fn randn(shape: [usize; 4]) -> Tensor<B, 4> {
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), &FlexDevice)
}

fn all_schedulers() -> Vec<Box<dyn Scheduler<B>>> {
    SchedulerKind::ALL
        .iter()
        .map(|&k| scheduler_from_config::<B>(&sd15().switched_to(k)).unwrap())
        .collect()
}

#[test]
fn step_before_set_timesteps_is_an_error() {
    for mut s in all_schedulers() {
        let x = randn([1, 4, 8, 8]);
        let err = s.step(x.clone(), 981.0, x, &mut NoNoise).unwrap_err();
        assert!(
            matches!(err, SchedulerError::NotInitialized { op: "step", .. }),
            "{}: {err}",
            s.kind()
        );
        assert!(err.to_string().contains("set_timesteps"), "{err}");
    }
}

#[test]
fn step_counts_outside_the_training_range_are_errors() {
    for mut s in all_schedulers() {
        for n in [0, 1001] {
            if n > 1000 && s.kind().is_flow_matching() {
                // diffusers' flow matching spaces any step count over [sigma_min, 1].
                s.set_timesteps(n).unwrap();
                assert_eq!(s.timesteps().len(), n * s.order() - (s.order() - 1));
                continue;
            }
            let err = s.set_timesteps(n).unwrap_err();
            assert!(
                matches!(err, SchedulerError::InvalidSteps { got, .. } if got == n),
                "{}: {err}",
                s.kind()
            );
        }
        s.set_timesteps(1000).unwrap_or_else(|e| {
            // Leading spacing with steps_offset 1 would need timestep 1000.
            assert!(matches!(e, SchedulerError::InvalidSteps { .. }), "{e}");
        });
    }
}

#[test]
fn prk_warm_up_needs_four_steps() {
    let mut cfg = sd15();
    cfg.skip_prk_steps = Some(false);
    let mut s = scheduler_from_config::<B>(&cfg).unwrap();
    let err = s.set_timesteps(3).unwrap_err();
    assert!(err.to_string().contains("at least 4 steps"), "{err}");
    s.set_timesteps(4).unwrap();
    assert_eq!(s.timesteps().len(), 12 + 1);
}

#[test]
fn ddim_offset_past_the_last_training_timestep_is_an_error() {
    let mut s: Box<dyn Scheduler<B>> = Box::new(DdimScheduler::new(&sd15()).unwrap());
    let err = s.set_timesteps(1000).unwrap_err();
    assert!(err.to_string().contains("steps_offset 1"), "{err}");
}

#[test]
fn wrong_timesteps_are_errors() {
    for mut s in all_schedulers() {
        s.set_timesteps(10).unwrap();
        let x = randn([1, 4, 8, 8]);
        let bad = if matches!(
            s.kind(),
            SchedulerKind::Pndm | SchedulerKind::Ddim | SchedulerKind::Ddpm
        ) {
            1.5
        } else {
            123.25
        };
        let err = s.step(x.clone(), bad, x, &mut NoNoise).unwrap_err();
        assert!(
            matches!(err, SchedulerError::BadTimestep { .. }),
            "{}: {err}",
            s.kind()
        );
    }
}

#[test]
fn stepping_past_the_schedule_is_an_error() {
    for kind in [
        SchedulerKind::Pndm,
        SchedulerKind::EulerDiscrete,
        SchedulerKind::DpmSolverMultistep,
        SchedulerKind::HeunDiscrete,
    ] {
        let mut s = scheduler_from_config::<B>(&sd15().switched_to(kind)).unwrap();
        s.set_timesteps(3).unwrap();
        let mut x = randn([1, 4, 8, 8]);
        let ts = s.timesteps().to_vec();
        for &t in &ts {
            x = s.step(randn([1, 4, 8, 8]), t, x, &mut NoNoise).unwrap();
        }
        let err = s
            .step(randn([1, 4, 8, 8]), ts[ts.len() - 1], x, &mut NoNoise)
            .unwrap_err();
        assert!(
            matches!(err, SchedulerError::ScheduleExhausted { .. }),
            "{kind}: {err}"
        );
    }
}

#[test]
fn stochastic_steps_report_a_missing_noise_source() {
    let mut s =
        scheduler_from_config::<B>(&sd15().switched_to(SchedulerKind::EulerAncestralDiscrete))
            .unwrap();
    s.set_timesteps(5).unwrap();
    let t = s.timesteps()[0];
    let x = randn([1, 4, 8, 8]);
    let err = s.step(x.clone(), t, x.clone(), &mut NoNoise).unwrap_err();
    assert!(matches!(err, SchedulerError::Noise(_)), "{err}");
    let mut wrong_shape = RecordedNoise::new([randn([1, 4, 4, 4])]);
    let err = s.step(x.clone(), t, x, &mut wrong_shape).unwrap_err();
    assert!(err.to_string().contains("shape"), "{err}");
}

#[test]
fn add_noise_checks_shapes() {
    for mut s in all_schedulers() {
        s.set_timesteps(10).unwrap();
        let t = s.timesteps()[0];
        let err = s
            .add_noise(randn([2, 4, 8, 8]), randn([2, 4, 8, 8]), &[t, t, t])
            .unwrap_err();
        assert!(matches!(err, SchedulerError::Shape { .. }), "{err}");
        let err = s
            .add_noise(randn([2, 4, 8, 8]), randn([1, 4, 8, 8]), &[t])
            .unwrap_err();
        assert!(matches!(err, SchedulerError::Shape { .. }), "{err}");
    }
}

#[test]
fn config_errors_name_the_file_and_field() {
    let err =
        SchedulerConfig::from_json_str(r#"{"beta_start": "tiny"}"#, "unet/sched.json").unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("unet/sched.json") && msg.contains("beta_start"),
        "{msg}"
    );

    let err =
        SchedulerConfig::from_json_str(r#"{"beta_schedule": "sigmoid"}"#, "a.json").unwrap_err();
    assert!(
        matches!(&err, SchedulerError::Field { field, .. } if field == "beta_schedule"),
        "{err}"
    );

    let err = SchedulerConfig::from_json_str("[1, 2]", "b.json").unwrap_err();
    assert!(err.to_string().contains("b.json"), "{err}");

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("scheduler_config.json");
    std::fs::write(
        &path,
        r#"{"_class_name": "DDIMScheduler", "steps_offset": -1}"#,
    )
    .unwrap();
    let err = SchedulerConfig::from_file(&path).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains(&path.display().to_string()) && msg.contains("steps_offset"),
        "{msg}"
    );

    let err = SchedulerConfig::from_file("/nonexistent/scheduler_config.json").unwrap_err();
    assert!(
        err.to_string()
            .contains("/nonexistent/scheduler_config.json"),
        "{err}"
    );
}

#[test]
fn config_ignores_unknown_fields_and_accepts_nulls() {
    let cfg = SchedulerConfig::from_json_str(
        r#"{"_class_name": "EulerDiscreteScheduler", "use_karras_sigmas": null,
            "sigma_min": null, "some_future_option": [1, 2, 3], "timestep_spacing": "trailing"}"#,
        "c.json",
    )
    .unwrap();
    assert!(!cfg.use_karras_sigmas);
    assert_eq!(cfg.timestep_spacing, Some(TimestepSpacing::Trailing));
    assert_eq!(cfg.num_train_timesteps, 1000);
    assert_eq!(cfg.kind().unwrap(), SchedulerKind::EulerDiscrete);
}

#[test]
fn unknown_scheduler_names_list_the_known_ones() {
    let err = "k_dpm_fast".parse::<SchedulerKind>().unwrap_err();
    let msg = err.to_string();
    for name in ["PNDMScheduler", "ddim", "euler", "euler_a"] {
        assert!(msg.contains(name), "{msg}");
    }
    let mut cfg = sd15();
    cfg.class_name = Some("RePaintScheduler".into());
    assert!(matches!(
        scheduler_from_config::<B>(&cfg),
        Err(SchedulerError::UnknownScheduler { .. })
    ));
    // Names diffusers maps to classes not implemented here say so and what is near.
    for (name, needle) in [
        ("DPM++ 2S a", "no diffusers equivalent"),
        ("DPM++ 2S a Karras", "no diffusers equivalent"),
        ("DPM fast", "no diffusers equivalent"),
    ] {
        let err = sd15().switched_to_named(name).unwrap_err();
        assert!(
            matches!(&err, SchedulerError::NotImplemented { .. })
                && err.to_string().contains(needle),
            "{name}: {err}"
        );
    }
    cfg.class_name = None;
    assert!(scheduler_from_config::<B>(&cfg).is_err());
}

#[test]
fn scheduler_names_parse_from_diffusers_short_and_a1111_names() {
    let cases = [
        ("PNDMScheduler", SchedulerKind::Pndm),
        ("pndm", SchedulerKind::Pndm),
        ("PLMS", SchedulerKind::Pndm),
        ("DDIM", SchedulerKind::Ddim),
        ("DDIMScheduler", SchedulerKind::Ddim),
        ("Euler", SchedulerKind::EulerDiscrete),
        ("EulerDiscreteScheduler", SchedulerKind::EulerDiscrete),
        ("Euler a", SchedulerKind::EulerAncestralDiscrete),
        ("euler_a", SchedulerKind::EulerAncestralDiscrete),
        ("euler-ancestral", SchedulerKind::EulerAncestralDiscrete),
        (
            "EulerAncestralDiscreteScheduler",
            SchedulerKind::EulerAncestralDiscrete,
        ),
        ("DPM++ 2M", SchedulerKind::DpmSolverMultistep),
        ("DPM2", SchedulerKind::KDpm2Discrete),
        ("DPM++ SDE", SchedulerKind::DpmSolverSinglestep),
        ("DEIS", SchedulerKind::DeisMultistep),
        (
            "DPMSolverSinglestepScheduler",
            SchedulerKind::DpmSolverSinglestep,
        ),
        ("KDPM2DiscreteScheduler", SchedulerKind::KDpm2Discrete),
        ("DPM2 a", SchedulerKind::KDpm2AncestralDiscrete),
        ("k_dpm_2_a", SchedulerKind::KDpm2AncestralDiscrete),
        ("LCM", SchedulerKind::Lcm),
        ("TCDScheduler", SchedulerKind::Tcd),
        (
            "FlowMatchEulerDiscreteScheduler",
            SchedulerKind::FlowMatchEulerDiscrete,
        ),
        ("flow_match_heun", SchedulerKind::FlowMatchHeunDiscrete),
        ("dpmpp_2m", SchedulerKind::DpmSolverMultistep),
        (
            "DPMSolverMultistepScheduler",
            SchedulerKind::DpmSolverMultistep,
        ),
    ];
    for (name, kind) in cases {
        assert_eq!(name.parse::<SchedulerKind>().unwrap(), kind, "{name}");
    }
}

#[test]
fn switching_class_keeps_betas_and_takes_the_new_class_defaults() {
    // diffusers drops the source class's unset defaults: Euler from SD 1.5's PNDM config
    // spaces timesteps with its own `linspace`, DDIM keeps the file's set_alpha_to_one.
    let euler = scheduler_from_config::<B>(&sd15().switched_to(SchedulerKind::EulerDiscrete));
    let mut euler = euler.unwrap();
    euler.set_timesteps(10).unwrap();
    assert_eq!(euler.timesteps()[..3], [999.0, 888.0, 777.0]);
    let mut ddim = scheduler_from_config::<B>(&sd15().switched_to(SchedulerKind::Ddim)).unwrap();
    ddim.set_timesteps(10).unwrap();
    assert_eq!(ddim.timesteps()[..3], [901.0, 801.0, 701.0]);
    assert_eq!(ddim.kind(), SchedulerKind::Ddim);
}

#[test]
fn unsupported_options_are_errors() {
    let mut cfg = sd15().switched_to(SchedulerKind::EulerDiscrete);
    cfg.use_beta_sigmas = true;
    cfg.use_karras_sigmas = true;
    assert!(matches!(
        scheduler_from_config::<B>(&cfg),
        Err(SchedulerError::Unsupported { .. })
    ));
    let mut cfg = sd15();
    cfg.trained_betas = Some(vec![0.1; 10]);
    let err = scheduler_from_config::<B>(&cfg).err().unwrap();
    assert!(err.to_string().contains("trained_betas"), "{err}");
}

#[test]
fn schedulers_are_send() {
    fn send<T: Send>(_: &T) {}
    for s in all_schedulers() {
        send(&s);
    }
}

#[test]
fn a1111_option_words_switch_class_and_options() {
    let cfg = sd15().switched_to_named("DPM++ 2M Karras").unwrap();
    assert_eq!(cfg.kind().unwrap(), SchedulerKind::DpmSolverMultistep);
    assert!(cfg.use_karras_sigmas);
    let cfg = sd15().switched_to_named("DPM++ 2M SDE Karras").unwrap();
    assert_eq!(
        cfg.algorithm_type,
        Some(AlgorithmType::SdeDpmSolverPlusPlus)
    );
    assert!(cfg.use_karras_sigmas);
    let cfg = sd15().switched_to_named("Euler").unwrap();
    assert!(!cfg.use_karras_sigmas);
    for bad in ["DDIM Karras", "Euler SDE", "nonsense Karras"] {
        assert!(sd15().switched_to_named(bad).is_err(), "{bad}");
    }
    let mut s =
        scheduler_from_config::<B>(&sd15().switched_to_named("DPM++ 2M Karras").unwrap()).unwrap();
    s.set_timesteps(12).unwrap();
    assert_eq!(s.timesteps()[..3], [999.0, 933.0, 854.0]);
}

#[test]
fn ddpm_rejects_learned_variances_and_off_schedule_timesteps() {
    for v in [
        VarianceType::Learned,
        VarianceType::LearnedRange,
        VarianceType::FixedLargeLog,
    ] {
        let mut cfg = sd15().switched_to(SchedulerKind::Ddpm);
        cfg.variance_type = Some(v);
        assert!(matches!(
            scheduler_from_config::<B>(&cfg),
            Err(SchedulerError::Unsupported { .. })
        ));
    }
    let mut s = scheduler_from_config::<B>(&sd15().switched_to(SchedulerKind::Ddpm)).unwrap();
    s.set_timesteps(10).unwrap();
    let x = randn([1, 4, 8, 8]);
    // 500 is a training timestep but not one of this schedule's.
    let err = s.step(x.clone(), 500.0, x, &mut NoNoise).unwrap_err();
    assert!(matches!(err, SchedulerError::BadTimestep { .. }), "{err}");
}

#[test]
fn python_non_finite_values_read_as_defaults() {
    // diffusers' save_config writes DPM-Solver's default lambda_min_clipped as -Infinity.
    let cfg = SchedulerConfig::from_json_str(
        r#"{"_class_name": "DPMSolverMultistepScheduler", "lambda_min_clipped": -Infinity,
            "sigma_max": NaN, "note": "-Infinity stays a string"}"#,
        "dpm.json",
    )
    .unwrap();
    assert_eq!(cfg.lambda_min_clipped, None);
    assert_eq!(cfg.sigma_max, None);
    let cfg = SchedulerConfig::from_json_str(r#"{"lambda_min_clipped": -5.1}"#, "x").unwrap();
    assert_eq!(cfg.lambda_min_clipped, Some(-5.1));
    assert!(SchedulerConfig::from_json_str(r#"{"a": Infinityx}"#, "y").is_err());
}

#[test]
fn dpm_solver_rejects_what_it_does_not_implement() {
    let base = sd15().switched_to(SchedulerKind::DpmSolverMultistep);
    let mut cases = Vec::new();
    let mut c = base.clone();
    c.algorithm_type = Some(AlgorithmType::DpmSolver);
    cases.push(c);
    let mut c = base.clone();
    c.solver_order = 4;
    cases.push(c);
    let mut c = base.clone();
    c.use_lu_lambdas = true;
    cases.push(c);
    let mut c = base.clone();
    c.use_karras_sigmas = true;
    c.use_exponential_sigmas = true;
    cases.push(c);
    for cfg in cases {
        assert!(matches!(
            scheduler_from_config::<B>(&cfg),
            Err(SchedulerError::Unsupported { .. })
        ));
    }
    let mut c = base.clone();
    c.lambda_min_clipped = Some(10.0);
    let mut s = scheduler_from_config::<B>(&c).unwrap();
    assert!(matches!(
        s.set_timesteps(10),
        Err(SchedulerError::InvalidSteps { .. })
    ));
}

#[test]
fn flow_matching_options_are_checked() {
    let flux = r#"{"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0,
                   "use_dynamic_shifting": true, "base_shift": 0.5, "max_shift": 1.15}"#;
    let cfg = SchedulerConfig::from_json_str(flux, "flux.json").unwrap();
    let mut s = scheduler_from_config::<B>(&cfg).unwrap();
    // Dynamic shifting without mu.
    let err = s.set_timesteps(4).unwrap_err();
    assert!(err.to_string().contains("needs `mu`"), "{err}");
    // Custom sigmas of the wrong count.
    let options = TimestepOptions {
        sigmas: Some(vec![1.0, 0.5]),
        mu: Some(1.15),
        ..Default::default()
    };
    let err = s.set_timesteps_with(4, &options).unwrap_err();
    assert!(
        matches!(err, SchedulerError::InvalidSteps { got: 4, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("2 custom sigmas"), "{err}");
    // Non-positive custom sigmas and a non-finite mu.
    let bad = TimestepOptions {
        sigmas: Some(vec![1.0, 0.0]),
        mu: Some(1.15),
        ..Default::default()
    };
    assert!(s.set_timesteps_with(2, &bad).is_err());
    let bad = TimestepOptions {
        mu: Some(f64::NAN),
        ..Default::default()
    };
    assert!(s.set_timesteps_with(2, &bad).is_err());
    let bad = TimestepOptions {
        mu: Some(1.0),
        timesteps: Some(vec![1000.0, 500.0, 1.0]),
        ..Default::default()
    };
    assert!(s.set_timesteps_with(2, &bad).is_err());
    s.set_timesteps_with(2, &options).unwrap();
    assert_eq!(s.timesteps().len(), 2);
    // Zero steps.
    assert!(matches!(
        s.set_timesteps_with(
            0,
            &TimestepOptions {
                mu: Some(1.0),
                ..Default::default()
            }
        ),
        Err(SchedulerError::InvalidSteps { got: 0, .. })
    ));
    // Bad config values.
    for (json, needle) in [
        (
            r#"{"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 0}"#,
            "shift must be",
        ),
        (
            r#"{"_class_name": "FlowMatchEulerDiscreteScheduler", "shift_terminal": 1.5}"#,
            "shift_terminal",
        ),
        (
            r#"{"_class_name": "FlowMatchEulerDiscreteScheduler", "use_karras_sigmas": true, "use_beta_sigmas": true}"#,
            "only one of",
        ),
        (
            r#"{"_class_name": "FlowMatchHeunDiscreteScheduler", "shift": -1.0}"#,
            "shift must be",
        ),
    ] {
        let cfg = SchedulerConfig::from_json_str(json, "x.json").unwrap();
        let err = scheduler_from_config::<B>(&cfg).err().unwrap();
        assert!(err.to_string().contains(needle), "{json}: {err}");
    }
    // shift_terminal 0 is unset in diffusers (`if shift_terminal:`).
    let timesteps = |json: &str| {
        let cfg = SchedulerConfig::from_json_str(json, "x.json").unwrap();
        let mut s = scheduler_from_config::<B>(&cfg).unwrap();
        s.set_timesteps(5).unwrap();
        s.timesteps().to_vec()
    };
    assert_eq!(
        timesteps(
            r#"{"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0, "shift_terminal": 0.0}"#
        ),
        timesteps(r#"{"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0}"#)
    );
    let err = SchedulerConfig::from_json_str(
        r#"{"_class_name": "FlowMatchEulerDiscreteScheduler", "time_shift_type": "cubic"}"#,
        "x.json",
    )
    .unwrap_err();
    assert!(err.to_string().contains("time_shift_type"), "{err}");
}

#[test]
fn schedulers_without_custom_sigmas_refuse_them() {
    for mut s in all_schedulers() {
        let options = TimestepOptions {
            sigmas: Some(vec![1.0, 0.5]),
            ..Default::default()
        };
        let result = s.set_timesteps_with(2, &options);
        if s.kind() == SchedulerKind::FlowMatchEulerDiscrete {
            result.unwrap();
            continue;
        }
        let err = result.unwrap_err();
        assert!(
            matches!(err, SchedulerError::Unsupported { .. }),
            "{}: {err}",
            s.kind()
        );
        assert!(err.to_string().contains("sigmas"), "{err}");
        // Default options are plain set_timesteps.
        s.set_timesteps_with(2, &TimestepOptions::default())
            .unwrap();
    }
}

#[test]
fn unipc_without_a_finite_last_step_is_refused() {
    // The configs for which diffusers 0.42.1 ends in NaN/inf (checked when the golden data
    // were made, see refused_configs() in tools/golden/make_schedulers.py).
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/golden/schedulers.json"
    );
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let refused = meta["refused"].as_array().unwrap();
    assert!(refused.len() >= 4);
    for case in refused {
        let cfg = SchedulerConfig::from_json_str(&case["config"].to_string(), "refused").unwrap();
        let err = scheduler_from_config::<B>(&cfg).err().unwrap();
        assert!(
            err.to_string().contains("final_sigmas_type `zero`")
                && err.to_string().contains("sigma_min"),
            "{err}"
        );
        let mut fixed = cfg.clone();
        fixed.final_sigmas_type = oxidiff_schedulers::FinalSigmasType::SigmaMin;
        scheduler_from_config::<B>(&fixed).unwrap();
    }
}

#[test]
fn a1111_names_of_the_k_diffusion_family_map_as_diffusers_documents() {
    // diffusers' A1111 table: "DPM++ SDE (Karras)" -> DPMSolverSinglestepScheduler
    // (use_karras_sigmas), "DPM2 (a) (Karras)" -> KDPM2(Ancestral)DiscreteScheduler.
    for (name, kind, karras) in [
        ("DPM++ SDE", SchedulerKind::DpmSolverSinglestep, false),
        ("DPM++ SDE Karras", SchedulerKind::DpmSolverSinglestep, true),
        ("DPM2", SchedulerKind::KDpm2Discrete, false),
        ("DPM2 Karras", SchedulerKind::KDpm2Discrete, true),
        ("DPM2 a", SchedulerKind::KDpm2AncestralDiscrete, false),
        ("DPM2 a Karras", SchedulerKind::KDpm2AncestralDiscrete, true),
        ("LMS Karras", SchedulerKind::LmsDiscrete, true),
        (
            "DPM++ 2M SDE Karras",
            SchedulerKind::DpmSolverMultistep,
            true,
        ),
    ] {
        let cfg = sd15().switched_to_named(name).unwrap();
        assert_eq!(cfg.kind().unwrap(), kind, "{name}");
        assert_eq!(cfg.use_karras_sigmas, karras, "{name}");
        assert_eq!(
            cfg.algorithm_type == Some(AlgorithmType::SdeDpmSolverPlusPlus),
            name.contains("2M SDE"),
            "{name}"
        );
    }
    assert!(sd15().switched_to_named("LCM Karras").is_err());
}

#[test]
fn deis_refuses_sde_algorithms_as_diffusers_does() {
    // A config carried over from "DPM++ 2M SDE": diffusers' DEIS raises NotImplementedError.
    let mut cfg = sd15().switched_to(SchedulerKind::DeisMultistep);
    cfg.algorithm_type = Some(AlgorithmType::SdeDpmSolverPlusPlus);
    let err = scheduler_from_config::<B>(&cfg).err().unwrap();
    assert!(
        err.to_string().contains("\"sde-dpmsolver++\"") && err.to_string().contains("\"deis\""),
        "{err}"
    );
    cfg.algorithm_type = Some(AlgorithmType::DpmSolverPlusPlus);
    scheduler_from_config::<B>(&cfg).unwrap();
}

#[test]
fn lcm_and_tcd_steps_are_a_subset_of_the_distillation_schedule() {
    for kind in [SchedulerKind::Lcm, SchedulerKind::Tcd] {
        let mut cfg = sd15().switched_to(kind);
        let mut s = scheduler_from_config::<B>(&cfg).unwrap();
        // 50 distillation steps by default: more inference steps cannot be picked from them.
        let err = s.set_timesteps(51).unwrap_err();
        assert!(
            err.to_string().contains("original_inference_steps (50)"),
            "{kind}: {err}"
        );
        s.set_timesteps(50).unwrap();
        assert_eq!(s.timesteps()[..2], [999.0, 979.0]);
        cfg.original_inference_steps = Some(2000);
        let mut s = scheduler_from_config::<B>(&cfg).unwrap();
        let err = s.set_timesteps(4).unwrap_err();
        assert!(
            err.to_string().contains("original_inference_steps must be"),
            "{err}"
        );
    }
}
