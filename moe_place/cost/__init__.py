"""moe_place.cost"""
