//! The planner's one error type. Every refusal names the field and, where two inputs disagree,
//! the equation with its values, torchtitan-style: "tp 3 does not divide heads 32".

/// Why an input was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    // === Input parsing ===
    /// A TOML or JSON document could not be read.
    #[error("cannot parse {what}: {message}")]
    Parse { what: String, message: String },

    // === Presets ===
    /// A preset name (model, device, link) is not known.
    #[error("{field}: unknown preset {name:?} (known: {known})")]
    UnknownPreset {
        field: &'static str,
        name: String,
        known: String,
    },

    // === Single values ===
    /// A value is out of range (negative bandwidth, zero layers, efficiency above 1, ...).
    #[error("{field} = {value} is invalid: {reason}")]
    Invalid {
        field: &'static str,
        value: String,
        reason: String,
    },

    // === Cross-field consistency ===
    /// Two or more inputs disagree; `equation` states the failed relation with its values.
    #[error("{field}: {equation}")]
    Inconsistent {
        field: &'static str,
        equation: String,
    },
}

/// The planner's result type.
pub type Result<T> = std::result::Result<T, PlanError>;

/// Refuses `value` unless it is finite and strictly positive.
pub(crate) fn positive(field: &'static str, value: f64) -> Result<f64> {
    if value.is_finite() && value > 0.0 {
        Ok(value)
    } else {
        Err(PlanError::Invalid {
            field,
            value: value.to_string(),
            reason: "must be a finite number > 0".into(),
        })
    }
}

/// Refuses `value` unless it is finite and >= 0.
pub(crate) fn non_negative(field: &'static str, value: f64) -> Result<f64> {
    if value.is_finite() && value >= 0.0 {
        Ok(value)
    } else {
        Err(PlanError::Invalid {
            field,
            value: value.to_string(),
            reason: "must be a finite number >= 0".into(),
        })
    }
}

/// Refuses `value` unless it lies in [0, 1].
pub(crate) fn fraction(field: &'static str, value: f64) -> Result<f64> {
    if value.is_finite() && (0.0..=1.0).contains(&value) {
        Ok(value)
    } else {
        Err(PlanError::Invalid {
            field,
            value: value.to_string(),
            reason: "must lie in [0, 1]".into(),
        })
    }
}

/// Checks `value <= max`, naming the field and the bound's reason: it keeps absurd inputs
/// from overflowing the arithmetic or printing figures hundreds of digits long.
pub(crate) fn at_most(field: &'static str, value: f64, max: f64, why: &str) -> Result<f64> {
    if value <= max {
        Ok(value)
    } else {
        Err(PlanError::Invalid {
            field,
            value: format!("{value:e}"),
            reason: format!("must be <= {max:e} ({why})"),
        })
    }
}

/// Refuses a zero count.
pub(crate) fn at_least_one(field: &'static str, value: u64) -> Result<u64> {
    if value >= 1 {
        Ok(value)
    } else {
        Err(PlanError::Invalid {
            field,
            value: value.to_string(),
            reason: "must be >= 1".into(),
        })
    }
}
