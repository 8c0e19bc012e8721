"""Agent dispatch boundaries: the action guardrails, the modes' tool surfaces and command table,
environment sanitisation, the in-process file tools and the credential broker."""

from cc_server.dispatch.actions import Action, ActionKind, ActionRefused
from cc_server.dispatch.credentials import CredentialBroker, CredentialUnavailable, Grant
from cc_server.dispatch.env import EnvRefused, looks_secret, sanitized_env
from cc_server.dispatch.guardrails import Guardrail, GuardrailChain, standard_chain
from cc_server.dispatch.modes import check_command, tools_for_mode
from cc_server.dispatch.tools import FileToolError, FileTools, SearchMatch

__all__ = [
    "Action",
    "ActionKind",
    "ActionRefused",
    "CredentialBroker",
    "CredentialUnavailable",
    "EnvRefused",
    "FileToolError",
    "FileTools",
    "Grant",
    "Guardrail",
    "GuardrailChain",
    "SearchMatch",
    "check_command",
    "looks_secret",
    "sanitized_env",
    "standard_chain",
    "tools_for_mode",
]
