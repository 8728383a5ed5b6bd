//! Durations written the way Kubernetes users write them: `5s`, `250ms`, `1m30s`, `2h`.
//!
//! The value keeps the text the user wrote (so a round trip through the API server is lossless) and
//! is parsed once on deserialisation, so a `Duration` in hand is always valid.

use std::{fmt, str::FromStr};

use schemars::JsonSchema;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The CRD pattern for a duration; it accepts exactly what [`Duration::from_str`] accepts.
pub const DURATION_PATTERN: &str = r"^([0-9]{1,9}(\.[0-9]{1,9})?(ms|s|m|h)){1,4}$";

/// A non-negative duration such as `5s` or `1m30s`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Duration {
    text: String,
    value: std::time::Duration,
}

/// Why a duration string was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid duration {text:?}: {why} (write e.g. 5s, 250ms, 1m30s)")]
pub struct DurationError {
    text: String,
    why: &'static str,
}

impl Duration {
    /// The parsed value.
    pub fn get(&self) -> std::time::Duration {
        self.value
    }

    /// The text as written.
    pub fn as_str(&self) -> &str {
        &self.text
    }
}

impl FromStr for Duration {
    type Err = DurationError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let err = |why| DurationError {
            text: text.to_owned(),
            why,
        };
        if text.is_empty() {
            return Err(err("empty"));
        }
        let mut total = std::time::Duration::ZERO;
        let mut rest = text;
        let mut parts = 0;
        while !rest.is_empty() {
            parts += 1;
            if parts > 4 {
                return Err(err("at most four number-unit parts"));
            }
            let number_len = rest
                .find(|c: char| !(c.is_ascii_digit() || c == '.'))
                .unwrap_or(rest.len());
            let (number, tail) = rest.split_at(number_len);
            if number.is_empty() || number.starts_with('.') || number.ends_with('.') || number.matches('.').count() > 1
            {
                return Err(err("expected a number before each unit"));
            }
            if number.split('.').any(|digits| digits.len() > 9) {
                return Err(err("at most nine digits on each side of the point"));
            }
            let (unit_secs, unit_len) = if tail.starts_with("ms") {
                (0.001, 2)
            } else if tail.starts_with('s') {
                (1.0, 1)
            } else if tail.starts_with('m') {
                (60.0, 1)
            } else if tail.starts_with('h') {
                (3600.0, 1)
            } else {
                return Err(err("expected a unit: ms, s, m or h"));
            };
            let n: f64 = number.parse().map_err(|_| err("bad number"))?;
            let part = std::time::Duration::try_from_secs_f64(n * unit_secs).map_err(|_| err("out of range"))?;
            total = total.checked_add(part).ok_or_else(|| err("out of range"))?;
            rest = &tail[unit_len..];
        }
        Ok(Duration {
            text: text.to_owned(),
            value: total,
        })
    }
}

impl fmt::Display for Duration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl Serialize for Duration {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.text)
    }
}

impl<'de> Deserialize<'de> for Duration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

impl JsonSchema for Duration {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Duration".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({ "type": "string", "pattern": DURATION_PATTERN })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration as Std;

    #[test]
    fn parses_units_and_sums() {
        let d = |s: &str| s.parse::<Duration>().map(|d| d.get());
        assert_eq!(d("5s"), Ok(Std::from_secs(5)));
        assert_eq!(d("250ms"), Ok(Std::from_millis(250)));
        assert_eq!(d("1m30s"), Ok(Std::from_secs(90)));
        assert_eq!(d("2h"), Ok(Std::from_secs(7200)));
        assert_eq!(d("1.5s"), Ok(Std::from_millis(1500)));
        assert_eq!(d("0s"), Ok(Std::ZERO));
    }

    #[test]
    fn rejects_bad_text_with_the_value_in_the_message() {
        for bad in [
            "",
            "5",
            "s",
            "5x",
            "-5s",
            "1.s",
            ".5s",
            "1..5s",
            "5 s",
            "5sm",
            "1234567890s",
            "1s1s1s1s1s",
        ] {
            let e = bad.parse::<Duration>().expect_err(bad);
            assert!(e.to_string().contains(&format!("{bad:?}")), "{e}");
        }
    }

    /// The pattern without its anchors, which proptest's generator does not support.
    fn unanchored() -> &'static str {
        DURATION_PATTERN.trim_start_matches('^').trim_end_matches('$')
    }

    proptest::proptest! {
        /// The API server checks the CRD pattern, everyone else the parser: every string the
        /// pattern accepts must parse.
        #[test]
        fn pattern_matches_parse(text in proptest::string::string_regex(unanchored()).expect("valid regex")) {
            proptest::prop_assert!(text.parse::<Duration>().is_ok(), "{}", text);
        }
    }

    #[test]
    fn round_trips_the_written_text() {
        let d: Duration = serde_json::from_str("\"1m30s\"").expect("valid");
        assert_eq!(serde_json::to_string(&d).expect("serialises"), "\"1m30s\"");
        let e = serde_json::from_str::<Duration>("\"soon\"").expect_err("invalid");
        assert!(e.to_string().contains("\"soon\""), "{e}");
    }
}
