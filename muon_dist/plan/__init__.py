"""What every rank will do, decided on the host alike on every rank: pure, no communication."""
