//! Kubernetes object names (DNS-1123), checked wherever a name from outside goes into an API
//! server URL or a watch: an engine's registration (its Pod and PDPair), the agent's published
//! PDEndpoints, the operator's `--namespace`.

/// `Err` naming `field` and `value` unless `value` is a DNS-1123 label (at most 63 bytes of
/// lowercase letters, digits and '-', starting and ending with a letter or digit): a
/// namespace's name.
pub fn check_dns1123_label(field: &str, value: &str) -> Result<(), String> {
    check(field, value, 63, false)
}

/// `Err` naming `field` and `value` unless `value` is a DNS-1123 subdomain (a label with '.'
/// too, at most 253 bytes): most objects' names (Pods, PDPairs).
pub fn check_dns1123_subdomain(field: &str, value: &str) -> Result<(), String> {
    check(field, value, 253, true)
}

fn check(field: &str, value: &str, max: usize, dots: bool) -> Result<(), String> {
    let ok_char = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-';
    let ends = |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    // A subdomain is labels joined by '.', each starting and ending with a letter or digit (of
    // any length within the whole's, as Kubernetes checks its names).
    let label = |l: &str| l.chars().all(ok_char) && ends(l.chars().next()) && ends(l.chars().last());
    let ok = if dots {
        value.split('.').all(label)
    } else {
        label(value)
    };
    if value.len() <= max && ok {
        return Ok(());
    }
    let kind = if dots { "subdomain" } else { "label" };
    Err(format!(
        "{field} {value:?} is not a Kubernetes name (DNS-1123 {kind}: lowercase letters, digits, '-'{}, at most {max} bytes)",
        if dots { ", '.'" } else { "" }
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_dns_1123_and_errors_name_the_field_and_value() {
        assert!(check_dns1123_subdomain("pod", "vllm-0.a").is_ok());
        assert!(check_dns1123_subdomain("pdpair's name", "llama.8b.x-1").is_ok());
        assert!(check_dns1123_subdomain("pod", &format!("{}.b", "a".repeat(100))).is_ok());
        assert!(check_dns1123_label("namespace", "team-a").is_ok());
        assert!(check_dns1123_label("namespace", &"n".repeat(63)).is_ok());
        for bad in [
            "../../attacker/pods/p",
            "p/q",
            "p%2f",
            "P",
            "p ",
            "-p",
            "p-",
            "",
            "a..b",
            "a.-b",
            "a-.b",
            ".a",
            &"p".repeat(254),
        ] {
            let e = check_dns1123_subdomain("pod", bad).expect_err(bad);
            assert!(e.starts_with(&format!("pod {bad:?} is not a Kubernetes name")), "{e}");
        }
        for bad in ["a.b", &"n".repeat(64), "Team", "a_b"] {
            let e = check_dns1123_label("namespace", bad).expect_err(bad);
            assert!(e.contains("DNS-1123 label") && e.contains("at most 63"), "{e}");
        }
    }
}
