"""`llmq acl`: Redis ACL rules for llmq's users (today: a tenant's producer)."""

from __future__ import annotations

import secrets

import click

from llmq.broker.keys import Keys
from llmq.broker.tenant_acl import TenantAcl


@click.group()
def acl() -> None:
    """Redis ACL rules for llmq's users."""


@acl.command("tenant")
@click.argument("name")
@click.option("--user", default=None, help="The Redis user name (default: the tenant's).")
@click.option("--password", envvar="LLMQ_TENANT_PASSWORD", default=None,
              help="Its password (default: a new random one, printed to stderr).")
@click.option("--prefix", envvar="LLMQ_PREFIX", default="llmq", show_default=True,
              help="Key prefix.")
def tenant(name: str, user: str | None, password: str | None, prefix: str) -> None:
    """Print the ACL rule of a producer for tenant NAME.

    It may submit, cancel and read results of its own request ids (NAME:<id>) only: add the
    line to the server's ACL file (then ACL LOAD), or pass what follows `user` to ACL SETUSER.
    """
    try:
        rules = TenantAcl(Keys(prefix), name)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="NAME") from None
    if password is None:
        password = secrets.token_hex(24)
        click.echo(f"password of {user or name}: {password} (only its hash is in the rule)",
                   err=True)
    click.echo(rules.rule(TenantAcl.password_hash(password), user))
