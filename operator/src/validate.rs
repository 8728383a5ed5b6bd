//! `pdpair-operator validate`: lint manifests before `kubectl apply`.
//!
//! Reads YAML streams, checks every PDPair with the rule table, and reports. Documents of other
//! kinds are skipped with a note (manifests mix kinds); nothing is skipped silently. A document
//! that claims to be a PDPair but does not parse as one, or has fields the CRD does not know (the
//! API server would silently prune them), is a problem that names the file, the document and the
//! field.

use std::fmt;

use pdpair_api::{PDPair, Violation};
use serde::{Deserialize, Serialize};

/// The apiVersion this operator serves.
pub const API_VERSION: &str = "pdpair.dev/v1alpha1";
const GROUP_PREFIX: &str = "pdpair.dev/";

/// The verdict on one PDPair, as `-o json` prints it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Checked {
    /// The file it came from (`-` for standard input).
    pub file: String,
    /// metadata.name.
    pub name: String,
    /// metadata.namespace, when the manifest sets one.
    pub namespace: Option<String>,
    /// Whether the pair would be admitted.
    pub allowed: bool,
    /// Every broken rule.
    pub violations: Vec<Violation>,
}

/// A file or document that could not be checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// The file.
    pub file: String,
    /// 1-based document index in the file; `None` when the file itself could not be read.
    pub document: Option<usize>,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.document {
            Some(doc) => write!(f, "{}: document {doc}: {}", self.file, self.message),
            None => write!(f, "{}: {}", self.file, self.message),
        }
    }
}

/// Everything one run found, in input order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Report {
    /// Checked PDPairs.
    pub checked: Vec<Checked>,
    /// Files and documents that could not be checked.
    pub problems: Vec<Problem>,
    /// Documents of other kinds, skipped: `file: document N: apiVersion kind name`.
    pub skipped: Vec<String>,
}

impl Report {
    /// 0 when every PDPair is admitted, 1 when any is rejected, 2 when any input was bad.
    pub fn exit_code(&self) -> u8 {
        if !self.problems.is_empty() {
            2
        } else if self.checked.iter().any(|c| !c.allowed) {
            1
        } else {
            0
        }
    }

    /// Checks one file's text.
    pub fn add_text(&mut self, file: &str, text: &str) {
        for (index, document) in serde_yaml::Deserializer::from_str(text).enumerate() {
            let doc = index + 1;
            let problem = |message: String| Problem {
                file: file.to_owned(),
                document: Some(doc),
                message,
            };
            // kubectl honours YAML merge keys (`<<: *anchor`); so must we.
            let value = match serde_yaml::Value::deserialize(document).and_then(|mut v| v.apply_merge().map(|()| v)) {
                Ok(value) => value,
                Err(e) => {
                    // The YAML stream is broken; later documents cannot be found reliably.
                    self.problems.push(problem(format!("invalid YAML: {e}")));
                    return;
                }
            };
            match self.add_document(file, doc, value) {
                Ok(()) => {}
                Err(message) => self.problems.push(problem(message)),
            }
        }
    }

    fn add_document(&mut self, file: &str, doc: usize, value: serde_yaml::Value) -> Result<(), String> {
        if value.is_null() {
            return Ok(()); // an empty document, such as after a trailing `---`
        }
        if !value.is_mapping() {
            return Err("not a Kubernetes object: expected a mapping with apiVersion and kind".into());
        }
        let text = |key: &str| value.get(key).and_then(serde_yaml::Value::as_str).map(str::to_owned);
        let (Some(api_version), Some(kind)) = (text("apiVersion"), text("kind")) else {
            return Err("not a Kubernetes object: apiVersion and kind must both be set".into());
        };
        if !api_version.starts_with(GROUP_PREFIX) || kind != "PDPair" {
            let name = value
                .get("metadata")
                .and_then(|m| m.get("name"))
                .and_then(serde_yaml::Value::as_str);
            self.skipped.push(format!(
                "{file}: document {doc}: {api_version} {kind} {}",
                name.unwrap_or("(unnamed)")
            ));
            return Ok(());
        }
        if api_version != API_VERSION {
            return Err(format!("apiVersion {api_version:?} is not served; use {API_VERSION:?}"));
        }
        let pair = parse_pdpair(value)?;
        if let Some((field, why)) = pair.spec.template_errors().into_iter().next() {
            return Err(format!("{field} is not a pod template: {why}"));
        }
        let name = pair
            .metadata
            .name
            .clone()
            .filter(|n| !n.is_empty())
            .ok_or("metadata.name is required")?;
        if let Some(why) = crate::webhook::name_too_long(&pair.metadata) {
            return Err(why);
        }
        let verdict = pdpair_api::check_admission(&pair.spec);
        self.checked.push(Checked {
            file: file.to_owned(),
            name,
            namespace: pair.metadata.namespace.clone(),
            allowed: verdict.allowed(),
            violations: verdict.violations,
        });
        Ok(())
    }

    /// Text for people: one line per PDPair, then one indented line per violation.
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        for c in &self.checked {
            let who = match &c.namespace {
                Some(ns) => format!("{ns}/{}", c.name),
                None => c.name.clone(),
            };
            let verdict = if c.allowed { "admitted" } else { "rejected" };
            out.push_str(&format!("{}: PDPair {who}: {verdict}\n", c.file));
            for v in &c.violations {
                out.push_str(&format!("    {} {}: {}\n", v.reason, v.field, v.message));
            }
        }
        out
    }

    /// One JSON array, one object per PDPair in input order.
    pub fn to_json(&self) -> String {
        // Plain data with string keys: serialisation cannot fail.
        serde_json::to_string_pretty(&self.checked).expect("the report serialises to JSON") + "\n"
    }

    /// What goes to standard error: skipped documents, problems, and a note when nothing was
    /// checked.
    pub fn notes(&self) -> String {
        let mut out = String::new();
        for s in &self.skipped {
            out.push_str(&format!("skipped {s} (not a PDPair)\n"));
        }
        for p in &self.problems {
            out.push_str(&format!("error: {p}\n"));
        }
        if self.checked.is_empty() && self.problems.is_empty() {
            out.push_str("note: no PDPair found in the input\n");
        }
        out
    }
}

/// Parses a PDPair, naming the field of the first type error and every unknown field.
fn parse_pdpair(value: serde_yaml::Value) -> Result<PDPair, String> {
    let pair: PDPair = serde_path_to_error::deserialize(value.clone()).map_err(|e| {
        let path = e.path().to_string();
        if path == "." {
            e.inner().to_string()
        } else {
            format!("{path}: {}", e.inner())
        }
    })?;
    let mut unknown = Vec::new();
    let templates: Vec<(String, serde_yaml::Value)> = ["prefill", "decode"]
        .into_iter()
        .filter_map(|pool| {
            let t = value.get("spec")?.get(pool)?.get("template")?;
            Some((format!("spec.{pool}.template"), t.clone()))
        })
        .collect();
    let _: Result<PDPair, _> = serde_ignored::deserialize(value, |path| {
        // The generated type reads apiVersion and kind from its resource impl, not from fields.
        // serde_ignored writes `?` for an Option's Some; a manifest path has no such step.
        let path = path.to_string().replace(".?", "");
        if path != "apiVersion" && path != "kind" {
            unknown.push(path);
        }
    });
    // Templates are read whole as JSON first (a stored one that is not a pod template is its
    // object's own fault): their unknown fields are looked for as pod templates.
    for (at, template) in templates {
        let _: Result<k8s_openapi::api::core::v1::PodTemplateSpec, _> = serde_ignored::deserialize(template, |path| {
            unknown.push(format!("{at}.{}", path.to_string().replace(".?", "")));
        });
    }
    if !unknown.is_empty() {
        let plural = if unknown.len() == 1 { "" } else { "s" };
        return Err(format!(
            "unknown field{plural} {} (the API server would drop {}; check the spelling)",
            unknown.join(", "),
            if unknown.len() == 1 { "it" } else { "them" }
        ));
    }
    Ok(pair)
}

/// Reads and checks files; `-` is standard input.
pub fn run(files: &[String]) -> Report {
    let mut report = Report::default();
    for file in files {
        let text = if file == "-" {
            std::io::read_to_string(std::io::stdin())
        } else {
            std::fs::read_to_string(file)
        };
        match text {
            Ok(text) => report.add_text(file, &text),
            Err(e) => report.problems.push(Problem {
                file: file.clone(),
                document: None,
                message: format!("cannot read: {e}"),
            }),
        }
    }
    report
}
